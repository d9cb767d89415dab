"""Chat messages, as OpenAI's API and `kiln chat --messages` take them, checked and made plain.

One validator for both front ends: the server turns a `MessageError` into a 400 whose `param` names
the field at fault (e.g. "messages[2].content"); the CLI prints it as its one-line error (it is a
`KilnError`). What one accepts the other accepts, in the same words.

Accepted: roles system, developer (= system), user, assistant, tool; content a string or an array
of `{"type": "text", "text": ...}` parts (joined with newlines); an optional string `name`; on
assistant messages `tool_calls` (arguments a JSON object, or a string holding one) and reasoning
text; on tool messages the `tool_call_id` of the call answered. The result is what a chat template
renders: developer mapped to system, parts joined, call arguments as objects, a tool result named
after its call.
"""

from __future__ import annotations

import json

from .errors import KilnError


class MessageError(KilnError):
    """A message the chat API does not accept; `param` is the path of the field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


# The fields each role may carry (others are refused, not ignored).
ROLE_FIELDS = {
    "system": {"content", "name"},
    "developer": {"content", "name"},
    "user": {"content", "name"},
    "assistant": {"content", "name", "tool_calls", "refusal", "annotations", "audio", "function_call",
                  "reasoning_content", "reasoning"},
    "tool": {"content", "tool_call_id", "name"},
}


def validate_messages(raw) -> list[dict]:
    """The messages, checked and made plain for a chat template; MessageError at the first mistake."""
    if not isinstance(raw, list) or not raw:
        raise MessageError("messages must be a non-empty array", "messages")
    out, names = [], {}
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{p} must be an object with a role and content", p)
        role = m.get("role")
        if role not in ROLE_FIELDS:
            raise MessageError(f"{p}.role must be one of {', '.join(ROLE_FIELDS)}; got {json.dumps(role)}",
                               f"{p}.role")
        for key in m:
            if key != "role" and key not in ROLE_FIELDS[role]:
                raise MessageError(f"{p}: unsupported field {key!r} for a {role} message", f"{p}.{key}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise MessageError(f"{p}.name must be a string", f"{p}.name")
        msg = {"role": "system" if role == "developer" else role}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        calls = _tool_calls(m.get("tool_calls"), p) if role == "assistant" else None
        msg["content"] = _content(m.get("content"), f"{p}.content", optional=role == "assistant")
        if calls:
            msg["tool_calls"] = calls
            names.update((c["id"], c["function"]["name"]) for c in calls)
            if not msg["content"]:
                msg["content"] = None  # templates test `message.content` before writing it
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise MessageError(f"{p}.{key} must be a string", f"{p}.{key}")
                    msg[key] = m[key]
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                raise MessageError(f"{p}.tool_call_id must be a string (the id of the call this answers)",
                                   f"{p}.tool_call_id")
            msg["tool_call_id"] = tid
            if "name" not in msg and tid in names:
                msg["name"] = names[tid]  # some templates write the function's name with its result
        out.append(msg)
    try:  # a JSON escape such as \ud800 decodes to a lone surrogate, which no tokenizer takes
        json.dumps(out, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise MessageError("messages hold an invalid Unicode escape (a lone surrogate)", "messages") from None
    return out


def _content(v, p: str, optional: bool) -> str:
    """String content, or text parts joined with newlines (as vLLM joins them)."""
    if v is None:
        if optional:
            return ""
        raise MessageError(f"{p} is required", p)
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise MessageError(f"{p} must be a string or an array of text parts", p)
    texts = []
    for j, part in enumerate(v):
        q = f"{p}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise MessageError(f'{q}: only text parts ({{"type": "text", "text": ...}}) are supported, '
                               f"got {json.dumps(kind)}", q)
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise MessageError(f'{q} must be {{"type": "text", "text": "..."}}', q)
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(v, p: str) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise MessageError(f"{p}.tool_calls must be an array", f"{p}.tool_calls")
    calls = []
    for j, c in enumerate(v):
        q = f"{p}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str) \
                or c.get("type", "function") != "function":
            raise MessageError(f'{q} must be {{"id": "...", "type": "function", '
                               f'"function": {{"name": "...", "arguments": "{{...}}"}}}}', q)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise MessageError(f"{q}.function.arguments is not valid JSON", f"{q}.function.arguments") from None
        if not isinstance(args, dict):
            raise MessageError(f"{q}.function.arguments must be a JSON object", f"{q}.function.arguments")
        # Templates index arguments as a mapping, as transformers and vLLM hand them over.
        calls.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls
