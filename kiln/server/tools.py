"""Tool calls in the model's own text format <-> OpenAI `tool_calls`.

A `ToolFormat` knows the markers around one call, how to parse a marked block, the text that forces
a call (tool_choice "required" or a named function) and extra stop strings. The format is chosen from
the chat template's source. `ToolStream` splits generated text, piece by piece, into content and
parsed calls; the server uses it for streamed and whole answers alike, so the two always agree.

Formats (what each model family generates):
  hermes       Qwen 2.5/3, Hermes:  <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>
  functiongemma  FunctionGemma (Gemma 3): <start_function_call>call:f{x:1,s:<escape>text<escape>}<end_function_call>
  gemma4       Gemma 4:             <|tool_call>call:f{x:1,s:<|"|>text<|"|>}<tool_call|>
  mistral      Mistral:             [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}
  json         Llama 3.x and any other template that takes tools: {"name": "f", "parameters": {...}}
  generic      a template that takes no tools (SmolLM2's), as llama-server's generic format: the tool
               schemas and an instruction in the system message; the whole answer is one JSON object,
               {"tool_call": {"name": "f", "arguments": {...}}} (or "tool_calls": [...]) or {"response": "..."}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def _call(name, arguments) -> ToolCall:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"bad function name {name!r}")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be a JSON object")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_objects(text: str) -> list:
    """Every JSON value in `text`, separated by whitespace, commas or semicolons."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def _from_dicts(values) -> list[ToolCall]:
    calls = []
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            if not isinstance(item, dict):
                raise ValueError("a tool call must be a JSON object")
            args = item.get("arguments", item.get("parameters"))
            calls.append(_call(item.get("name"), args))
    if not calls:
        raise ValueError("no tool call")
    return calls


class ToolFormat:
    name = ""
    start = ""                 # opens a call block
    also: tuple[str, ...] = () # other openers
    end: str | None = None     # closes it; None: the block runs to the end of the text
    stops: tuple[str, ...] = ()
    in_template = True         # the chat template writes the tools into the prompt (False: `render` does)

    def stream(self, parallel: bool = True) -> "ToolStream":
        """A parser for one answer, fed as it is generated."""
        return ToolStream(self, parallel)

    def parse(self, block: str) -> list[ToolCall]:
        """The calls in one block (markers included); ValueError if it is not a valid call."""
        raise NotImplementedError

    def prefix(self, name: str | None) -> str:
        """Text appended to the prompt so the model writes a call (to `name` when given)."""
        return self.start

    def _inner(self, block: str) -> str:
        body = block[len(self.start):] if block.startswith(self.start) else block
        if self.end and body.endswith(self.end):
            body = body[:-len(self.end)]
        return body


class Hermes(ToolFormat):
    name, start, end = "hermes", "<tool_call>", "</tool_call>"

    def parse(self, block):
        return _from_dicts(_json_objects(self._inner(block)))

    def prefix(self, name):
        return "<tool_call>\n" + (f'{{"name": "{name}", "arguments": ' if name else "")


class GemmaCall(ToolFormat):
    """`call:NAME{key:value,...}`: strings between a delimiter token, objects and lists nested, other
    values bare (numbers, true, false, null)."""
    quote = ""

    def parse(self, block):
        body = self._inner(block).strip()
        if not body.startswith("call:"):
            raise ValueError("expected call:NAME{...}")
        brace = body.find("{")
        if brace < 0:
            raise ValueError("expected call:NAME{...}")
        value, end = self._value(body, brace)
        if body[end:].strip():
            raise ValueError(f"unexpected text after the call: {body[end:]!r}")
        return [_call(body[5:brace].strip(), value)]

    def prefix(self, name):
        return self.start + "call:" + (name + "{" if name else "")

    def _value(self, s: str, i: int):
        """The value starting at s[i] and the index just after it."""
        if s.startswith(self.quote, i):
            j = s.find(self.quote, i + len(self.quote))
            if j < 0:
                raise ValueError("unterminated string")
            return s[i + len(self.quote):j], j + len(self.quote)
        if s.startswith("{", i):
            return self._items(s, i + 1, "}", keyed=True)
        if s.startswith("[", i):
            return self._items(s, i + 1, "]", keyed=False)
        j = i
        while j < len(s) and s[j] not in ",}]":
            j += 1
        text = s[i:j].strip()
        try:
            return json.loads(text), j
        except json.JSONDecodeError:
            return text, j  # a bare word the model did not quote: keep it as a string

    def _items(self, s: str, i: int, close: str, keyed: bool):
        out: dict | list = {} if keyed else []
        while True:
            if i >= len(s):
                raise ValueError(f"missing {close!r}")
            if s[i] == close:
                return out, i + 1
            if keyed:
                colon = s.find(":", i)
                if colon < 0:
                    raise ValueError("expected key:value")
                key = s[i:colon].strip()
                value, i = self._value(s, colon + 1)
                out[key] = value
            else:
                value, i = self._value(s, i)
                out.append(value)
            if i < len(s) and s[i] == ",":
                i += 1
            elif i < len(s) and s[i] != close:
                raise ValueError(f"unexpected {s[i]!r} at {i}")


class FunctionGemma(GemmaCall):
    name, start, end, quote = "functiongemma", "<start_function_call>", "<end_function_call>", "<escape>"
    stops = ("<start_function_response>",)  # the model would go on to imagine the tool's answer


class Gemma4(GemmaCall):
    name, start, end, quote = "gemma4", "<|tool_call>", "<tool_call|>", '<|"|>'
    stops = ("<|tool_response>",)


class Mistral(ToolFormat):
    name, start, end = "mistral", "[TOOL_CALLS]", None

    def parse(self, block):
        calls = []
        for part in block.split(self.start)[1:]:
            if "[ARGS]" in part:  # v11+: NAME[ARGS]{...}, one call per marker
                name, args = part.split("[ARGS]", 1)
                calls += [_call(name.strip(), value) for value in _json_objects(args)]
            else:
                calls += _from_dicts(_json_objects(part))
        if not calls:
            raise ValueError("no tool call")
        return calls

    def prefix(self, name):
        return self.start + (f'[{{"name": "{name}", "arguments": ' if name else "")


class JsonCall(ToolFormat):
    """Llama 3.x and the fallback: the answer is one or more JSON objects with name and parameters."""
    name, start, end, also = "json", '{"name"', None, ("<|python_tag|>",)

    def parse(self, block):
        return _from_dicts(_json_objects(block.removeprefix("<|python_tag|>")))

    def prefix(self, name):
        return f'{{"name": "{name}", "parameters": ' if name else self.start


FORMATS = {f.name: f for f in (Gemma4(), FunctionGemma(), Hermes(), Mistral(), JsonCall())}


def detect(template: str | None) -> ToolFormat | None:
    """The format a chat template's model writes calls in; None if the template ignores tools."""
    if not template or "tools" not in template:
        return None
    for fmt in FORMATS.values():
        if fmt.start in template and fmt.name != "json":
            return fmt
    return FORMATS["json"]


_FENCE = re.compile(r"```[A-Za-z]*[ \t]*\n?")


class Generic(ToolFormat):
    """For chat templates that take no tools, as llama-server's generic format (which it runs under a
    grammar; kiln, without one, parses what the model wrote). `render` writes the tool schemas and an
    instruction into the system message, and earlier calls and tool results into the history as the
    same JSON; the answer is one JSON object, optionally in a ``` fence:
    {"tool_call": {"name": ..., "arguments": {...}}}, {"tool_calls": [...]} or {"response": "..."}.
    Text after the object stays content; an answer that is not such an object is content as written."""
    name, start, in_template = "generic", '{"tool_call"', False

    def prefix(self, name):
        return '{"tool_call": {"name": ' + (f'"{name}", "arguments": ' if name else '"')

    def stream(self, parallel=True):
        return GenericStream(self, parallel)

    def parse(self, block):
        calls, _ = self.read(block)
        if not calls:
            raise ValueError("no tool call")
        return calls

    def read(self, text: str) -> tuple[list[ToolCall], str]:
        """(calls, content) of a whole answer; ValueError when it does not start with such an object."""
        body = text.strip()
        fence = _FENCE.match(body)
        if fence:
            body = body[fence.end():]
        value, end = json.JSONDecoder().raw_decode(body)
        rest = body[end:].strip()
        if fence and rest.startswith("```"):
            rest = rest[3:].strip()
        if not isinstance(value, dict):
            raise ValueError("the answer must be a JSON object")
        if "tool_call" in value or "tool_calls" in value:
            return _from_dicts([value.get("tool_call", value.get("tool_calls"))]), rest
        if "response" in value:
            answer = value["response"]
            answer = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False, indent=2)
            return [], "\n\n".join(t for t in (answer, rest) if t)
        raise ValueError('expected "tool_call", "tool_calls" or "response"')

    def render(self, messages: list[dict], tools: list[dict] | None, name: str | None = None) -> list[dict]:
        """`messages` (validated, as kiln/messages.py gives them) for a template that takes no tools:
        an assistant's calls written as the JSON the model is asked for, tool results as user turns
        (consecutive ones merged into one), and with `tools`, the schemas and the instruction appended
        to the system message (or put in a new one)."""
        out: list[dict] = []
        results_at = -1   # the index in `out` of the user turn that holds the latest tool results
        for m in messages:
            if m["role"] == "tool":
                result = json.dumps({"tool_response": {"name": m.get("name"), "tool_call_id": m["tool_call_id"],
                                                       "content": m["content"]}}, ensure_ascii=False)
                if results_at == len(out) - 1 and out:
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                else:
                    out.append({"role": "user", "content": result})
                    results_at = len(out) - 1
                continue
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in m["tool_calls"]]
                text = json.dumps({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls},
                                  ensure_ascii=False)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = text + (f"\n\n{m['content']}" if m.get("content") else "")
            out.append(m)
        if tools:
            text = self.instructions(tools, name)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def instructions(self, tools: list[dict], name: str | None = None) -> str:
        """The system message's text: the tools, and how to answer (an example call to `name`, or the
        first tool)."""
        fn = next((t["function"] for t in tools if t["function"]["name"] == name), tools[0]["function"])
        example = {"tool_call": {"name": fn["name"], "arguments": _example_arguments(fn.get("parameters"))}}
        return ("You can call any of the following tools to satisfy the user's requests: "
                + json.dumps(tools, indent=2, ensure_ascii=False)
                + "\n\nRespond in JSON format, either with `tool_call` (a request to call a tool) or with "
                  "`response` (a reply to the user's request), for example:\n"
                + json.dumps(example, ensure_ascii=False) + '\nor\n{"response": "<your reply>"}')


def _example_arguments(schema) -> dict:
    """Placeholder arguments for an example call: the required properties (or all, at most 4) with a
    value of their type."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return {}
    required = schema.get("required")
    keys = [k for k in required if k in props] if isinstance(required, list) else []
    out = {}
    for key in (keys or list(props))[:4]:
        kind = props[key].get("type") if isinstance(props[key], dict) else None
        out[key] = _EXAMPLE_VALUES[kind] if isinstance(kind, str) and kind in _EXAMPLE_VALUES else f"<{key}>"
    return out


_EXAMPLE_VALUES = {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


GENERIC = Generic()


class GenericStream:
    """The generic format's parser: an answer that starts (after whitespace) with text other than `{`
    or a ``` fence is content and passes through as it comes; one that starts with either is held to
    the end and read whole (calls and the text after them, the response, or, if it does not parse,
    the text as written)."""

    def __init__(self, fmt: Generic, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.buf, self.mode = "", None   # mode: None (only whitespace yet), "text" or "json"
        self.calls = 0

    def push(self, text: str) -> list[tuple[str, object]]:
        if self.mode == "text":
            return [("content", text)] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if self.mode is None and head:
            self.mode = "json" if head[0] in "{`" else "text"
            if self.mode == "text":
                text, self.buf = self.buf, ""
                return [("content", text)]
        return []

    def finish(self) -> list[tuple[str, object]]:
        text, self.buf = self.buf, ""
        if self.mode != "json":
            return [("content", text)] if text else []
        try:
            calls, content = self.fmt.read(text)
        except Exception:  # whatever the model wrote (deep nesting included), it stays the model's text
            return [("content", text)]
        if not self.parallel:
            calls = calls[:1]
        self.calls += len(calls)
        return [("call", c) for c in calls] + ([("content", content)] if content else [])


class ToolStream:
    """Splits generated text into ("content", str) and ("call", ToolCall) events as it arrives.

    Text that may be the start of a call marker is held back until the next piece decides it; a
    block that does not parse is given back as content. Whitespace between content and a call is
    dropped. The events do not depend on how the text is cut into pieces.
    """

    def __init__(self, fmt: ToolFormat, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.markers = (fmt.start, *fmt.also)
        self.buf, self.in_call, self._opener = "", False, 0
        self.calls = 0
        self._ws, self._after_call = "", False

    def push(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out: list[tuple[str, object]] = []
        fmt = self.fmt
        while True:
            if not self.in_call:
                i, opener = min(((self.buf.find(m), m) for m in self.markers if m in self.buf), default=(-1, ""))
                if i < 0:
                    cut = len(self.buf) - max(_partial_suffix(self.buf, m) for m in self.markers)
                    out += self._content(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                out += self._content(self.buf[:i])
                self.buf, self.in_call, self._opener = self.buf[i:], True, len(opener)
            else:
                j = self.buf.find(fmt.end, self._opener) if fmt.end else -1
                if j < 0:
                    return out
                j += len(fmt.end)
                out += self._block(self.buf[:j])
                self.buf, self.in_call = self.buf[j:], False

    def finish(self) -> list[tuple[str, object]]:
        out = self._block(self.buf) if self.in_call else self._content(self.buf)
        self.buf, self.in_call = "", False
        if not self.calls and not self._after_call and self._ws:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    def _block(self, raw: str) -> list[tuple[str, object]]:
        try:
            calls = self.fmt.parse(raw)
        except Exception:  # whatever the model wrote (deep nesting included), it stays the model's text
            return self._content(raw)
        if not self.parallel:
            calls = calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        self._ws, self._after_call = "", True
        return [("call", c) for c in calls]

    def _content(self, text: str) -> list[tuple[str, object]]:
        body = text.rstrip()
        if not body:
            self._ws += text
            return []
        lead = self._ws + body
        if self._after_call:
            lead = lead.lstrip()
        self._ws, self._after_call = text[len(body):], False
        return [("content", lead)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
