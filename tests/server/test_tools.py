"""Tool calls: the parsers on real formatted strings of each format, and a round trip through a
real server with the official openai client on a model whose template takes tools (support.py)."""

from __future__ import annotations

import json

import openai
import pytest

from kiln.server import tools
from kiln.server.tools import ToolCall

from .support import ANSWER, TEMPLATE, TOOLS, Server, build_tool_model

# What the models write (from their model cards and chat templates), and the calls in it.
REAL = {
    "hermes": [
        ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
         '"unit": "celsius"}}\n</tool_call>',
         "", [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
        ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "24h": true}}\n</tool_call>',
         "Let me check both.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "24h": True})]),
    ],
    "functiongemma": [
        ("<start_function_call>call:get_current_weather{location:<escape>Tokyo, Japan<escape>}<end_function_call>",
         "", [("get_current_weather", {"location": "Tokyo, Japan"})]),
        ("<start_function_call>call:get_current_temperature{location:<escape>Paris<escape>,unit:<escape>celsius"
         "<escape>}<end_function_call><start_function_call>call:search{query:<escape>a, {b} \"c\"<escape>,"
         "limit:5,exact:true,filters:{lang:<escape>fr<escape>,tags:[<escape>x<escape>,<escape>y<escape>]}}"
         "<end_function_call>",
         "", [("get_current_temperature", {"location": "Paris", "unit": "celsius"}),
              ("search", {"query": 'a, {b} "c"', "limit": 5, "exact": True,
                          "filters": {"lang": "fr", "tags": ["x", "y"]}})]),
    ],
    "gemma4": [
        ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
         "", [("get_weather", {"city": "Paris", "days": 3})]),
        ('Sure.<|tool_call>call:convert{amount:12.5,from:<|"|>EUR<|"|>,to:<|"|>USD<|"|>}<tool_call|>',
         "Sure.", [("convert", {"amount": 12.5, "from": "EUR", "to": "USD"})]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"tz": "CET"}}]',
         "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
         "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ],
    "json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {}}',
         "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ],
}
CASES = [(fmt, text, content, calls) for fmt, items in REAL.items() for text, content, calls in items]


def _events(fmt, pieces: list[str], parallel: bool = True):
    """(content, calls) from feeding `pieces` one by one to format `fmt` (a name, or a ToolFormat)."""
    stream, events = (tools.FORMATS[fmt] if isinstance(fmt, str) else fmt).stream(parallel), []
    for p in pieces:
        events += stream.push(p)
    events += stream.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"]
    return content, calls


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_reads_real_formatted_calls(fmt, text, content, calls):
    assert _events(fmt, [text]) == (content, calls)
    assert _events(fmt, list(text)) == (content, calls)  # one character at a time, as a stream may cut it


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_result_does_not_depend_on_where_the_stream_is_cut(fmt, text, content, calls):
    for cut in range(1, len(text)):
        assert _events(fmt, [text[:cut], text[cut:]]) == (content, calls), cut


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("functiongemma", "<start_function_call>call:f{x:<escape>open}<end_function_call>"),
    ("gemma4", "<|tool_call>call:f{x:1<tool_call|>"),
    ("mistral", "[TOOL_CALLS] [not json]"),
])
def test_a_malformed_call_is_given_back_as_content(fmt, text):
    assert _events(fmt, [text]) == (text, [])


def test_plain_text_passes_through_unchanged():
    text = "Plain answer with a < sign, a {brace} and a trailing newline\n"
    for fmt in tools.FORMATS:
        if fmt != "json":
            assert _events(fmt, list(text)) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = REAL["hermes"][1][0]
    assert _events("hermes", [text], parallel=False) == ("Let me check both.", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("fmt, name, rest, call", [
    ("hermes", "get_weather", '{"city": "Paris"}}\n</tool_call>', ("get_weather", {"city": "Paris"})),
    ("hermes", None, '{"name": "f", "arguments": {}}\n</tool_call>', ("f", {})),
    ("functiongemma", "get_weather", "city:<escape>Paris<escape>}<end_function_call>",
     ("get_weather", {"city": "Paris"})),
    ("gemma4", None, 'f{a:<|"|>b<|"|>}<tool_call|>', ("f", {"a": "b"})),
    ("mistral", "f", '{"a": 1}}]', ("f", {"a": 1})),
    ("json", "f", '{"a": 1}}', ("f", {"a": 1})),
])
def test_forced_call_prefix_and_its_continuation_parse(fmt, name, rest, call):
    prefix = tools.FORMATS[fmt].prefix(name)
    assert _events(fmt, [prefix, rest]) == ("", [(call[0], call[1])])


@pytest.mark.parametrize("template, fmt", [
    ("{% for t in tools %}{{ t | tojson }}{% endfor %} <tool_call> {{ messages }}", "hermes"),
    ("{% if tools %}<start_function_declaration>{% endif %}<start_function_call>", "functiongemma"),
    ("{% if tools %}{% endif %}<|tool_call>call:", "gemma4"),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{% if tools %}Respond with {\"name\": ..., \"parameters\": ...}{% endif %}", "json"),
])
def test_format_is_detected_from_the_template(template, fmt):
    assert tools.detect(template).name == fmt


def test_a_template_without_tools_has_no_format():
    smollm = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    assert tools.detect(smollm) is None and tools.detect(None) is None


def test_the_server_reads_the_call_format_from_a_tool_use_template(tmp_path):
    """A model whose default template ignores tools but that ships a "tool_use" template beside it."""
    import kiln
    from kiln.server.app import Service

    path = build_tool_model(tmp_path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    # A template that ignores tools gets the generic format (the tools written into the system message).
    assert Service(kiln.load(path, device="cpu", dtype="f32"), "m", None, 1).tool_format.name == "generic"
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)
    assert Service(kiln.load(path, device="cpu", dtype="f32"), "m", None, 1).tool_format.name == "hermes"


# ------------------------------------------------------------------------------------------------
# The generic format (templates that take no tools): one JSON object is the whole answer

CALL_JSON = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
GENERIC = [
    (CALL_JSON, "", [("get_weather", {"city": "Paris"})]),
    ("\n  " + CALL_JSON + "\n", "", [("get_weather", {"city": "Paris"})]),
    ("```json\n" + CALL_JSON + "\n```", "", [("get_weather", {"city": "Paris"})]),
    ("```\n" + CALL_JSON + "\n```\n", "", [("get_weather", {"city": "Paris"})]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('{"tool_call": {"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}}', "", [("get_time", {"tz": "CET"})]),
    (CALL_JSON + "\n\nThe weather in Paris is nice.", "The weather in Paris is nice.",
     [("get_weather", {"city": "Paris"})]),
    ('{"response": "Paris is the capital of France."}', "Paris is the capital of France.", []),
    ('```json\n{"response": "Hi! {braces} and \\"quotes\\""}\n```', 'Hi! {braces} and "quotes"', []),
    ("Paris is the capital of France.\n", "Paris is the capital of France.\n", []),
    ("  A plain answer with a {brace} in it.", "  A plain answer with a {brace} in it.", []),
]
GENERIC_MALFORMED = [
    '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}',    # cut short
    '{"tool_call": {"name": "get_weather", "arguments": [1, 2]}}',               # arguments not an object
    '{"tool_call": {"name": "bad name!", "arguments": {}}}',
    '{"tool_call": "get_weather"}',
    '{"answer": "Paris"}',
    "{not json}",
    "```json\nnot json\n```",
    "[" * 5000 + "]" * 5000,
]


def _generic(pieces: list[str], parallel: bool = True):
    return _events(tools.GENERIC, pieces, parallel)


@pytest.mark.parametrize("text, content, calls", GENERIC, ids=[str(i) for i in range(len(GENERIC))])
def test_generic_parser_reads_calls_answers_and_plain_text(text, content, calls):
    assert _generic([text]) == (content, calls)
    assert _generic(list(text)) == (content, calls)
    for cut in range(1, len(text)):
        assert _generic([text[:cut], text[cut:]]) == (content, calls), cut


@pytest.mark.parametrize("text", GENERIC_MALFORMED, ids=[str(i) for i in range(len(GENERIC_MALFORMED))])
def test_generic_parser_gives_malformed_json_back_as_text(text):
    assert _generic([text]) == (text, [])


def test_generic_plain_text_streams_as_it_comes():
    stream = tools.GENERIC.stream(True)
    assert stream.push("  ") == [] and stream.push("Hello") == [("content", "  Hello")]
    assert stream.push(" world") == [("content", " world")] and stream.finish() == []
    held = tools.GENERIC.stream(True)
    assert held.push('{"response": ') == [] and held.push('"Hi"}') == [] and held.finish() == [("content", "Hi")]


def test_generic_parallel_tool_calls_false_keeps_the_first_call():
    text = GENERIC[4][0]
    assert _generic([text], parallel=False) == ("", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("name, rest, call", [
    ("get_weather", ' {"city": "Paris"}}}', ("get_weather", {"city": "Paris"})),
    (None, 'get_weather", "arguments": {"city": "Paris"}}}', ("get_weather", {"city": "Paris"})),
])
def test_generic_forced_call_prefix_and_its_continuation_parse(name, rest, call):
    assert _generic([tools.GENERIC.prefix(name), rest]) == ("", [call])


def test_generic_render_puts_the_tools_in_the_system_message_and_writes_the_history_as_json():
    history = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_time", "content": "noon"},
    ]
    out = tools.GENERIC.render(history, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert json.dumps(TOOLS, indent=2) in system and '"tool_call"' in system and '"response"' in system
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                            {"name": "get_time", "arguments": {}}]}
    # Consecutive tool results become one user turn (templates that want roles to alternate).
    results = [json.loads(line) for line in out[3]["content"].splitlines()]
    assert results == [{"tool_response": {"name": "get_weather", "tool_call_id": "c1", "content": "sunny"}},
                       {"tool_response": {"name": "get_time", "tool_call_id": "c2", "content": "noon"}}]
    # An existing system message keeps its text, the tools follow it; without tools nothing is added.
    own = tools.GENERIC.render([{"role": "system", "content": "Be brief."}] + history[:1], TOOLS)
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    assert tools.GENERIC.render(history[:1], None) == history[:1]


def test_tool_call_arguments_are_a_json_object_string():
    assert tools._call("f", {"a": "é"}) == ToolCall("f", '{"a": "é"}')
    assert tools._call("f", '{"a": 1}') == ToolCall("f", '{"a": 1}')
    with pytest.raises(ValueError):
        tools._call("f", [1, 2])
    with pytest.raises(ValueError):
        tools._call("bad name!", {})


# ------------------------------------------------------------------------------------------------
# A round trip through a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tool_model(tmp_path_factory.mktemp("toolmodel"))
    srv = Server(str(path), "--quiet", "--model-id", "tool-model").wait()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_chat(client, **kw):
    """(content, tool calls, finish_reason, usage) from a streamed chat; checks the chunk order."""
    kw.setdefault("model", "tool-model")
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finish = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finish[-1] is not None and not any(finish[:-1])
    content, calls = "", {}
    for c in chunks[:-1]:
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish[-1], chunks[-1].usage


def test_tool_round_trip(client):
    first = client.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert first.usage.completion_tokens == 4  # <tool_call>\n, the JSON, \n</tool_call>, <|im_end|>

    # The assistant message goes back as the client returned it, then the tool's result.
    messages = USER + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    # The second prompt extends the first one and the call: the state for all of it was reused.
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 3


def test_streamed_tool_calls_equal_the_whole_answer(client):
    whole = client.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS)
    content, calls, finish, usage = _stream_chat(client, messages=USER, tools=TOOLS)
    assert content == "" and finish == "tool_calls"
    (want,) = whole.choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [(want.function.name, want.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)

    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert _stream_chat(client, messages=messages, tools=TOOLS)[:3] == (ANSWER, [], "stop")


def test_tool_choice_none_leaves_the_text_alone(client):
    out = client.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS, tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content.startswith("<tool_call>\n")


def test_tool_choice_required_forces_a_call(client):
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    auto = client.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS)
    assert auto.choices[0].message.content == ANSWER   # left to itself, the model answers
    forced = client.chat.completions.create(model="tool-model", messages=messages, tools=TOOLS, tool_choice="required")
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tool_requests_that_cannot_be_served_are_400(client):
    for kw, param in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tool-model", messages=USER, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param


# ------------------------------------------------------------------------------------------------
# The generic format end to end: the bundled SmolLM2, whose template takes no tools

SMOL = "smollm2-135m"
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol():
    srv = Server(SMOL, "--quiet").wait()
    yield srv.client()
    srv.stop()


def _well_formed(choice, names):
    assert choice.finish_reason == "tool_calls" and choice.message.role == "assistant"
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_generic_tool_call_on_smollm2(smol, choice):
    out = smol.chat.completions.create(model=SMOL, messages=WEATHER, tools=TOOLS, tool_choice=choice,
                                       temperature=0, max_tokens=48)
    assert out.object == "chat.completion" and out.usage.completion_tokens <= 48
    _well_formed(out.choices[0], {"get_weather"})
    # Streamed, the same call arrives as one delta.
    content, calls, finish, usage = _stream_chat(smol, model=SMOL, messages=WEATHER, tools=TOOLS, tool_choice=choice,
                                                 temperature=0, max_tokens=48)
    want = out.choices[0].message
    assert finish == "tool_calls" and content == (want.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in want.tool_calls]
    assert usage.completion_tokens == out.usage.completion_tokens


def test_generic_round_trip_and_auto_on_smollm2(smol):
    first = smol.chat.completions.create(model=SMOL, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    messages = WEATHER + [first.choices[0].message,
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    for choice in ("auto", "none"):
        out = smol.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=24)
        c = out.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls") and out.usage.prompt_tokens > 0
        if c.message.tool_calls:
            _well_formed(c, {"get_weather"})
        else:
            assert isinstance(c.message.content, str) and c.message.content
    # Left to itself, on a question no tool answers, the model writes text: it comes back as content.
    plain = smol.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                         tools=TOOLS, temperature=0, max_tokens=24)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
