"""`kiln serve`: load a model and serve it over an OpenAI-compatible HTTP API (loopback by default)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from .. import hub
from ..errors import KilnError
from .flags import add_runtime_flags, load_announced, positive_int


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {s!r}")
    return v


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_runtime_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $KILN_API_KEY if set)")
    p.add_argument("--model-id", default=None, help="the model's name in the API (default: from MODEL)")
    p.add_argument("--queue-limit", type=positive_int, default=64,
                   help="requests that may wait for the engine; more get 429 (default 64)")
    p.add_argument("--max-batch", type=positive_int, default=1,
                   help="prompts decoded together, joining and leaving between steps (default 1: one request "
                        "at a time, with the CUDA graph and prefix reuse; docs/batching.md)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    p.set_defaults(main=main)


def default_model_id(model: str | None) -> str:
    if model is None:
        return hub.DEFAULT_MODEL
    if model in hub.BUNDLED:
        return model
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name or str(model))


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise KilnError(f"cannot resolve --host {host!r}") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KilnError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(a) -> int:
    key = a.api_key if a.api_key is not None else os.environ.get("KILN_API_KEY") or None
    if key is not None and not key.strip():
        raise KilnError("the API key must not be empty")
    if not a.host:
        raise KilnError("--host must not be empty")
    if key is None and not a.insecure and not is_loopback(a.host):
        raise KilnError(f"refusing to serve on {a.host}, which is not a loopback address, without an API key: "
                        "pass --api-key KEY (or set KILN_API_KEY), or --insecure to serve it open")
    with bind(a.host, a.port) as sock:
        import uvicorn

        from ..server.app import create_app  # FastAPI: imported only when serving

        llm = load_announced(a)
        model_id = a.model_id or default_model_id(a.model)
        app = create_app(llm, model_id, api_key=key, queue_limit=a.queue_limit, max_batch=a.max_batch)
        host, port = sock.getsockname()[:2]
        if not a.quiet:
            shown = f"[{host}]" if ":" in host else host
            print(f"kiln: serving {model_id} on http://{shown}:{port}/v1" + (" (API key required)" if key else ""),
                  file=sys.stderr)
        config = uvicorn.Config(app, log_level="critical" if a.quiet else "info", access_log=not a.quiet,
                                timeout_graceful_shutdown=3)
        uvicorn.Server(config).run(sockets=[sock])
    return 0
