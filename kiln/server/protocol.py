"""OpenAI request bodies -> validated requests; every mistake is an `ApiError` in OpenAI's shape.

Validation is written out (a table of fields and a few checks) rather than left to pydantic, so each
error names the one field at fault (`param`, e.g. "messages[2].content") in a sentence a user can act
on, and nothing a client sends reaches the engine unchecked. Fields kiln does not implement are
accepted only at the value that leaves the answer unchanged; unknown fields are refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from ..messages import MessageError, validate_messages

_MAX_SEED = 2**64 - 1
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object (NaN and Infinity refused: they are not JSON)."""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError:
        raise bad("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:  # JSON escapes such as \ud800 decode to lone surrogates, which no tokenizer takes
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad("the request body holds an invalid Unicode escape (a lone surrogate)") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    return body


# ------------------------------------------------------------------------------------------------
# Scalar fields


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# name: (integer?, test, what it must be). None (or absent) means kiln's default.
_SAMPLING = {
    "temperature": (False, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (True, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1] (0 = off)"),
    # Bounded so that logits / penalty cannot overflow to inf (inf - inf is NaN: no token to sample).
    "repetition_penalty": (False, lambda v: 0.01 <= v <= 100, "a number in [0.01, 100] (1 = off)"),
    "seed": (True, lambda v: 0 <= v <= _MAX_SEED, "an integer in [0, 2**64 - 1]"),
    "max_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "max_completion_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
}
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": None}

# Fields kiln does not implement, accepted only at the value that changes nothing.
_OFF = {
    "n": (1,), "best_of": (1,), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
    "response_format": ({"type": "text"},), "modalities": (["text"],),
}
# Fields that never change the answer: accepted and ignored.
_IGNORED = {"user", "metadata", "store", "service_tier", "model"}

_COMMON = {"model", "stream", "stream_options", "stop", "ignore_eos", *_SAMPLING, *_OFF, *_IGNORED}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt"}


def _scalar(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    integer, test, what = _SAMPLING[name]
    if not (_is_int(v) if integer else _is_num(v)) or not test(v):
        raise bad(f"{name} must be {what}, got {json.dumps(v)}", name)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad(f"unsupported field {name!r}", name, "unsupported_field")
    for name, values in _OFF.items():
        v = body.get(name)
        if v is not None and not any(v == ok and isinstance(v, bool) == isinstance(ok, bool) for ok in values):
            raise bad(f"{name}={json.dumps(v)} is not supported (kiln accepts only {json.dumps(values[0])})",
                      name, "unsupported_value")
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise bad("model must be a string", "model")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > 16 or not all(isinstance(s, str) and s for s in items):
        raise bad("stop must be a non-empty string or a list of at most 16 non-empty strings", "stop")
    return tuple(items)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise bad('stream_options must be {"include_usage": true|false}', "stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return True, usage


@dataclass
class Request:
    """What every endpoint shares: sampling settings, length, stop strings, streaming."""
    sampling: dict                    # SamplingParams keyword arguments, bar max_new_tokens and stop
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None


def _common(body: dict, allowed: set[str]) -> Request:
    _check_fields(body, allowed)
    values = {name: _scalar(body, name) for name in _SAMPLING}
    a, b = values.pop("max_tokens"), values.pop("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise bad("max_tokens and max_completion_tokens differ; give one of them", "max_completion_tokens")
    sampling = {k: (_DEFAULTS[k] if v is None else v) for k, v in values.items()}
    if sampling["temperature"] < 1e-5:  # as vLLM: below this it is greedy (and 1e-320 would be 0/0 in f32)
        sampling["temperature"] = 0.0
    ignore = body.get("ignore_eos", False)    # vLLM's extension: a fixed output length for benchmarks
    if not isinstance(ignore, bool):
        raise bad(f"ignore_eos must be true or false, got {json.dumps(ignore)}", "ignore_eos")
    sampling["ignore_eos"] = ignore
    stream, usage = _stream(body)
    return Request(sampling, b if b is not None else a, _stop(body), stream, usage, body.get("model"))


# ------------------------------------------------------------------------------------------------
# /v1/completions


MAX_PROMPTS = 128  # prompts in one /v1/completions request (each is answered in turn, in one queue slot)
_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


@dataclass
class CompletionRequest(Request):
    prompts: list[str | list[int]] = field(default_factory=list)   # one choice each, in this order


def parse_completion(body: dict) -> CompletionRequest:
    req = _common(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad("prompt is required", "prompt")
    return CompletionRequest(**vars(req), prompts=_prompts(body["prompt"]))


def _prompts(v) -> list[str | list[int]]:
    """The prompts of a request, as OpenAI takes them: a string, a list of token ids, or a batch (a
    list) of either kind, not mixed."""
    if isinstance(v, str):
        if not v:
            raise bad("prompt must not be empty", "prompt")
        return [v]
    if not isinstance(v, list):
        raise bad(f"prompt must be {_PROMPT_FORMS}", "prompt")
    if not v:
        raise bad("prompt must not be an empty list", "prompt")
    if all(_is_int(i) for i in v):
        return [v]
    if all(isinstance(p, str) for p in v):
        kind = "string"
    elif all(isinstance(p, list) for p in v):
        kind = "list of token ids"
    else:
        raise bad(f"prompt must be {_PROMPT_FORMS} (one kind, not a mix)", "prompt")
    if len(v) > MAX_PROMPTS:
        raise bad(f"prompt holds {len(v)} prompts; at most {MAX_PROMPTS} go in one request", "prompt")
    for i, p in enumerate(v):
        if not p:
            raise bad(f"prompt[{i}] is empty", "prompt")
        if kind != "string" and not all(_is_int(t) for t in p):
            raise bad(f"prompt[{i}] must be a list of token ids (integers)", "prompt")
    return v


# ------------------------------------------------------------------------------------------------
# /v1/chat/completions


@dataclass
class ChatRequest(Request):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: str = "auto"             # "auto" | "none" | "required" | "function"
    tool_name: str | None = None          # the function tool_choice names
    parallel_tool_calls: bool = True


def parse_chat(body: dict) -> ChatRequest:
    req = _common(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return ChatRequest(**vars(req), messages=messages, tools=tools, tool_choice=choice, tool_name=name,
                       parallel_tool_calls=parallel)


def _messages(raw) -> list[dict]:
    if raw is None:
        raise bad("messages is required", "messages")
    try:
        return validate_messages(raw)   # the rules kiln chat --messages applies too
    except MessageError as e:
        raise bad(str(e), e.param) from None


def _tools(v) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad("tools must be an array of function tools", "tools")
    seen = set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f'{p} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', p)
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"{p}.function.name must be 1-64 letters, digits, _ or -", f"{p}.function.name")
        if name in seen:
            raise bad(f"{p}: the function name {name!r} appears twice", f"{p}.function.name")
        seen.add(name)
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "true or false")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad(f"{p}.function.{key} must be {what}", f"{p}.function.{key}")
    return v or None


def _tool_choice(v, tools) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("auto", "none", "required"):
        choice, name = v, None
    elif isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        choice, name = "function", v["function"]["name"]
    else:
        raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                  "tool_choice")
    if not tools and choice in ("required", "function"):
        raise bad(f"tool_choice {json.dumps(v)} needs tools", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return choice, name
