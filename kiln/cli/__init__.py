"""The `kiln` command line: run, chat, pull, models.

Generated text goes to stdout as it is produced; statistics and progress go to stderr; user
mistakes end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from .errors import KilnError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too)
        raise KilnError(message)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _finite(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def _token_ids(s: str) -> list[int]:
    from .synth import parse_token_ids
    return parse_token_ids(s)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (run, chat, and later serve/bench)."""
    p.add_argument("model", nargs="?", default=None,
                   help="a path (HF folder or .gguf), a bundled model name, or synth:NAME[:layers=N][:seed=S]")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None,
                   help="weights and activations (default: bf16 on GPU, f32 on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"],
                   help="kernels: cuda (Triton, tuned at load) or reference (plain torch); auto (default) = cuda on a GPU")
    p.add_argument("--enforce-eager", action="store_true", help="cuda backend: run decode steps eagerly, not as a CUDA graph")
    p.add_argument("--max-context", type=_positive_int, default=None, help="cap on prompt + generated tokens")
    p.add_argument("--retune", action="store_true", help="cuda backend: measure kernels again even on a cache hit")
    p.add_argument("--tune", action="append", default=[], metavar="OP=VARIANT",
                   help="cuda backend: pin a kernel variant for every shape of OP (repeatable)")
    p.add_argument("--quiet", action="store_true", help="print nothing on stderr")


def add_sampling_flags(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-new", type=_positive_int, default=256, help="max new tokens (default 256)")
    p.add_argument("--temperature", type=_finite, default=temperature, help=f"0 = greedy (default {temperature})")
    p.add_argument("--top-k", type=_nonneg_int, default=0, help="0 = off")
    p.add_argument("--top-p", type=_finite, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=_finite, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=_finite, default=1.0, help="1 = off")
    p.add_argument("--seed", type=_nonneg_int, default=None, help="same seed, same sampled text")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); excluded from the output")


def sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=tuple(a.stop))


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is not there yet
        return False


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="kiln", description="kiln: LLM inference that compiles its kernels for your model")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="raw completion of a prompt (no chat template)")
    add_runtime_flags(run)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids (models without a tokenizer)")
    src.add_argument("--random-prompt", type=_positive_int, metavar="N", help="N random token ids (seeded by --seed)")
    add_sampling_flags(run, temperature=0.0)

    chat = sub.add_parser("chat", help="chat with the model's template (interactive, or --messages once)")
    add_runtime_flags(chat)
    chat.add_argument("--messages", default=None, help="JSON array of messages (file path or '-' for stdin); answers once")
    chat.add_argument("--system", default=None, help="system message")
    add_sampling_flags(chat, temperature=0.7)

    pull = sub.add_parser("pull", help="install a bundled model into the kiln cache")
    pull.add_argument("name", help="bundled model name (see `kiln models`)")
    pull.add_argument("--force", action="store_true", help="download again even if installed")
    pull.add_argument("--quiet", action="store_true")

    sub.add_parser("models", help="list bundled models and where they are installed")
    for module in PLUGINS.values():
        if _exists(module):
            importlib.import_module(module).add_parser(sub)
    return parser


def load_from_args(a):
    """kiln.load with the runtime flags of `add_runtime_flags`."""
    from .api import load
    from .tune.cli import parse_pins

    return load(a.model, device=a.device, dtype=a.dtype, backend=a.backend, max_context=a.max_context,
                quiet=a.quiet, retune=a.retune, tune=parse_pins(a.tune), enforce_eager=a.enforce_eager)


def _load(a):
    llm = load_from_args(a)
    if not a.quiet:
        print(f"kiln: loaded {llm.path.name} ({type(llm.model).__name__}, {llm.engine.dtype}, "
              f"{llm.engine.device}) in {llm.load_s:.2f} s", file=sys.stderr)
    return llm


def _emit(pieces, stats_of, quiet: bool) -> None:
    """Stream text pieces to stdout, then the statistics line to stderr."""
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        print(stats_of().line(), file=sys.stderr)


def cmd_run(a) -> int:
    prompt = a.prompt_ids
    if a.prompt is not None:
        prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
        if not prompt:
            raise KilnError("empty prompt")
    llm = _load(a)
    from .api import _Run
    from .sampling import SamplingParams

    if a.random_prompt:
        from .synth import random_prompt
        prompt = random_prompt(a.random_prompt, llm.config.vocab_size, a.seed or 0)
    elif isinstance(prompt, str) and llm.tokenizer is None:
        raise KilnError("this model has no tokenizer: give --prompt-ids or --random-prompt")
    run = _Run(llm, llm._prompt_ids(prompt), SamplingParams(**sampling_kwargs(a)))
    # Without a tokenizer the generated token ids are the output (comma-separated, as --prompt-ids takes them).
    pieces = run if llm.tokenizer is not None else (("," if i else "") + str(t) for i, t in enumerate(run.stream.ids))
    _emit(pieces, run.stats, a.quiet)
    return 0


def _read_messages(src: str) -> list[dict]:
    try:
        text = sys.stdin.read() if src == "-" else Path(src).read_text()
        messages = json.loads(text)
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read messages from {src}: {e}") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"messages in {src} are not valid JSON: {e}") from None
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
        for m in messages)
    if not ok:
        raise KilnError('messages must be a non-empty JSON array of {"role": ..., "content": "..."} objects')
    return messages


def _answer(llm, messages, a) -> str:
    from .api import _Run
    from .sampling import SamplingParams

    run = _Run(llm, llm.chat_prompt(messages), SamplingParams(**sampling_kwargs(a)))
    parts = []

    def tee():
        for piece in run:
            parts.append(piece)
            yield piece

    _emit(tee(), run.stats, a.quiet)
    return "".join(parts)


def cmd_chat(a) -> int:
    messages = _read_messages(a.messages) if a.messages else []
    if a.system is not None:
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": a.system})
    llm = _load(a)
    if a.messages:
        _answer(llm, messages, a)
        return 0
    interactive = sys.stdin.isatty()
    if interactive and not a.quiet:
        print("kiln chat: type a message; /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    base = list(messages)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(base)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": _answer(llm, messages, a)})


def cmd_pull(a) -> int:
    from . import hub

    path = hub.pull(a.name, quiet=a.quiet, force=a.force)
    print(path)
    return 0


def cmd_models(a) -> int:
    from . import hub

    for name, b in hub.BUNDLED.items():
        where = str(hub.model_path(name)) if hub.is_installed(name) else "not installed (kiln pull " + name + ")"
        default = " (default)" if name == hub.DEFAULT_MODEL else ""
        print(f"{name}{default}\t{b.about}\t{where}")
    return 0


COMMANDS = {"run": cmd_run, "chat": cmd_chat, "pull": cmd_pull, "models": cmd_models}
# Subcommands that live in their own module: each has add_parser(subparsers) and main(args) -> int.
PLUGINS = {
    "serve": "kiln.server.cli",
    "bench": "kiln.bench",
    "profile": "kiln.profile",
    "synth": "kiln.synth",
    "compare": "kiln.compare",
    "tune": "kiln.tune.cli",
    "kernels": "kiln.tune.cli_kernels",
}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        return importlib.import_module(PLUGINS[args.command]).main(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not a user mistake: one line unless KILN_DEBUG asks for the trace
        if os.environ.get("KILN_DEBUG"):
            raise
        print(f"kiln: internal error: {type(e).__name__}: {e} (set KILN_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
