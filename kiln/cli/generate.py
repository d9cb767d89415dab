"""`kiln run` (a raw completion) and `kiln chat` (the model's chat template, interactive or once).

Generated text goes to stdout as it is produced; the statistics line goes to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..api import Generation, render_chat
from ..errors import KilnError
from ..messages import validate_messages
from ..weights.synth import random_prompt
from .flags import (
    add_runtime_flags,
    add_sampling_flags,
    load_announced,
    positive_int,
    sampling_params,
    save_expert_profile,
    token_ids,
)


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="raw completion of a prompt (no chat template)")
    add_runtime_flags(run)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text ('-' reads stdin)")
    src.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids (models without a tokenizer)")
    src.add_argument("--random-prompt", type=positive_int, metavar="N", help="N random token ids (seeded by --seed)")
    add_sampling_flags(run, temperature=0.0)
    run.set_defaults(main=cmd_run)

    chat = sub.add_parser("chat", help="chat with the model's template (interactive, or --messages once)")
    add_runtime_flags(chat)
    chat.add_argument("--messages", default=None,
                      help="JSON array of messages (file path or '-' for stdin); answers once")
    chat.add_argument("--system", default=None, help="system message")
    add_sampling_flags(chat, temperature=0.7)
    chat.set_defaults(main=cmd_chat)


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
    params = sampling_params(a)
    llm = load_announced(a, check=_tokenizer_check(prompt))
    if a.random_prompt:
        prompt = random_prompt(a.random_prompt, llm.config.vocab_size, a.seed or 0)
    run = Generation(llm, llm.encode(prompt), params)
    # Without a tokenizer the generated token ids are the output (comma-separated, as --prompt-ids takes them).
    pieces = run if llm.tokenizer is not None else (("," if i else "") + str(t) for i, t in enumerate(run.stream.ids))
    _emit(pieces, run.stats, a.quiet)
    save_expert_profile(llm, a)
    return 0


def _tokenizer_check(prompt):
    """A check for kiln.load: a text prompt needs a tokenizer (known before the weights load)."""
    def check(tokenizer) -> None:
        if isinstance(prompt, str) and tokenizer is None:
            raise KilnError("this model has no tokenizer: give --prompt-ids or --random-prompt")
    return check


def _read_messages(src: str) -> list[dict]:
    """The messages in a JSON file (or stdin), checked by the rules the server applies (kiln/messages.py):
    what `/v1/chat/completions` refuses with a 400 is refused here in the same words, before any load."""
    try:
        text = sys.stdin.read() if src == "-" else Path(src).read_text()
        messages = json.loads(text)
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read messages from {src}: {e}") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"messages in {src} are not valid JSON: {e}") from None
    except RecursionError:
        raise KilnError(f"messages in {src} are nested too deeply") from None
    return validate_messages(messages)   # a MessageError is a KilnError: one line, exit 2


def _answer(llm, messages, params, a) -> str:
    run = Generation(llm, llm.chat_prompt(messages), params)
    parts = []

    def tee():
        for piece in run:
            parts.append(piece)
            yield piece

    _emit(tee(), run.stats, a.quiet)
    return "".join(parts)


def _template_check(messages: list[dict]):
    """A check for kiln.load: the chat template renders `messages`, so a model that cannot chat (no
    template, no tokenizer) is refused before its weights load."""
    return lambda tokenizer: render_chat(tokenizer, messages)


def cmd_chat(a) -> int:
    messages = _read_messages(a.messages) if a.messages else []
    if a.system is not None:
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": a.system})
    params = sampling_params(a)
    # Interactive, the first prompt is the history plus one user turn: check that shape.
    first = messages if a.messages else messages + [{"role": "user", "content": "hi"}]
    llm = load_announced(a, check=_template_check(first))
    if a.messages:
        _answer(llm, messages, params, a)
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
        messages.append({"role": "assistant", "content": _answer(llm, messages, params, a)})
