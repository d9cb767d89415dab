"""The Python API's public pieces on the hand-built tool model (tests/server/support.py), whose greedy
answers are known: plain text continues "!!!..." for as long as allowed; a chat prompt gets a tool
call, then the end-of-turn token. LLM.encode on text and on ids; Generation iterated and completed."""

from __future__ import annotations

import pytest

import kiln
from kiln import Generation, KilnError, SamplingParams

from .server.support import CALL, build_tool_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return kiln.load(build_tool_model(tmp_path_factory.mktemp("tool")), device="cpu", dtype="f32")


def test_the_package_exports_generation_and_its_params():
    assert {"Generation", "SamplingParams"} <= set(kiln.__all__)


def test_encode_takes_text_or_ids(llm):
    assert llm.encode("Hi!") == llm.tokenizer.encode("Hi!")
    assert llm.encode("Hi!", add_special_tokens=False) == llm.tokenizer.encode("Hi!", add_special_tokens=False)
    assert llm.encode((5, 0, 7)) == [5, 0, 7]


def test_encode_errors_are_kiln_errors(llm):
    vocab = llm.config.vocab_size
    for prompt, says in (("", "empty prompt"), ([], "non-empty list"), ([1, vocab], f"in \\[0, {vocab}\\)"),
                         ([-1], "integers"), ([1.0], "integers")):
        with pytest.raises(KilnError, match=says):
            llm.encode(prompt)
    bare = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")
    with pytest.raises(KilnError, match="no tokenizer"):
        bare.encode("Hi!")
    assert bare.encode([3, 4]) == [3, 4]


def test_a_generation_iterated_gives_text_pieces_then_its_finish(llm):
    ids = llm.encode("Hello")
    gen = Generation(llm, ids, SamplingParams(max_new_tokens=5))
    assert gen.finish_reason is None
    assert "".join(gen) == "!!!!!"
    assert gen.token_ids == [llm.tokenizer.token_to_id("!")] * 5 and gen.finish_reason == "length"
    stats = gen.stats()
    assert (stats.prompt_tokens, stats.generated_tokens) == (len(ids), 5)


def test_a_completed_generation_equals_generate(llm):
    out = Generation(llm, llm.encode("Hello"), SamplingParams(max_new_tokens=5)).complete()
    want = llm.generate("Hello", max_new_tokens=5)
    assert (out.text, out.token_ids, out.finish_reason) == (want.text, want.token_ids, want.finish_reason)


def test_a_chat_generation_stops_at_the_end_of_turn(llm):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = Generation(llm, llm.chat_prompt(messages), SamplingParams(max_new_tokens=20)).complete()
    assert out.finish_reason == "eos" and CALL in out.text and out.token_ids[-1] in llm.eos_ids
    assert out.stats.line().endswith("| finish eos")
    assert out.text == llm.chat(messages, max_new_tokens=20).text


def test_a_stop_string_ends_it(llm):
    gen = Generation(llm, llm.encode("Hello"), SamplingParams(max_new_tokens=10, stop=["!!!"]))
    assert "".join(gen) == "" and gen.finish_reason == "stop" and len(gen.token_ids) == 3
    assert gen.stats().line().endswith("| finish stop")


def test_the_max_context_ends_it_with_its_own_reason(tmp_path_factory):
    """"context" when the model's context (here --max-context) ran out first, "length" when max_new_tokens did."""
    small = kiln.load(build_tool_model(tmp_path_factory.mktemp("tool")), device="cpu", dtype="f32", max_context=6)
    ids = small.encode("Hello")
    room = small.engine.max_context - len(ids)
    out = small.generate(ids, max_new_tokens=room + 5)
    assert (out.finish_reason, len(out.token_ids)) == ("context", room)
    assert out.stats.line().endswith("| finish context (max context 6 tokens)")
    out = small.generate(ids, max_new_tokens=room)
    assert (out.finish_reason, len(out.token_ids)) == ("length", room)
    assert out.stats.line().endswith("| finish length")


def test_close_ends_the_engine_loop(llm):
    gen = Generation(llm, llm.encode("Hello"), SamplingParams(max_new_tokens=10))
    assert next(iter(gen)) == "!"
    gen.close()
    assert list(gen.stream.ids) == [] and gen.stream.times.generated_tokens == 1


def test_text_cut_inside_a_character_ends_before_it_streamed_or_not():
    """SmolLM2 on the issue's prompt: its 12th token is the first half of a character. The completion's
    text and the streamed pieces are the same, without the half character (no U+FFFD)."""
    real = kiln.load("smollm2-135m", device="cpu", dtype="f32")
    out = real.generate("日本の首都は", max_new_tokens=12)
    assert real.tokenizer.decode(out.token_ids).endswith("\ufffd")    # the cut this test is about
    pieces = list(real.stream("日本の首都は", max_new_tokens=12))
    assert out.text == "".join(pieces) == real.tokenizer.decode(out.token_ids)[:-1]
    assert "\ufffd" not in out.text
