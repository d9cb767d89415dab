"""kiln.tokenizer against transformers on the two bundled GGUF files.

The contract: `Tokenizer.from_gguf(metadata).encode(text)` gives exactly the ids of
`AutoTokenizer.from_pretrained(dir, gguf_file=name)(text)["input_ids"]`, decode matches transformers'
decode, chat templates render the same text, and StreamDecoder's pieces add up to decode().
transformers is loaded once per model (module-scoped fixtures); gemma's takes ~15 s of the total.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kiln import hub
from kiln import tokenizer as tokenizer_module
from kiln.errors import KilnError
from kiln.tokenizer import StreamDecoder, Tokenizer
from kiln.weights.gguf_file import GGUFFile

MODELS = ["smollm2-135m", "gemma3-270m"]

COMMON = [
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée à Noël",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "日本語のテキストと中文",
    "emoji 😀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 heart ❤️",
    "a  b   c\t\td\n\n\ne",
    "   leading spaces",
    "trailing spaces   ",
    "def add(a, b):\n    if a > b:\n        return {'sum': a + b}\n    return [a, b]\n",
    "12345 3.14159 2018-01-22",
    "",
    " ",
    "\u00a0non-breaking\u2009thin space\r\nCRLF",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑∫√ and a replacement char \ufffd",
    "rare: 𠜎𠜱𠝹 🫨 ꙮ 𐀀",
]
SPECIAL_TEXT = {
    "smollm2-135m": ["<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x<repo_name>"],
    "gemma3-270m": ["<start_of_turn>user hi<end_of_turn>", "<bos>", "<bos>hello<eos>", "[multimodal] <mask>"],
}
# The rare characters (CJK extension B, a new emoji, Cyrillic ꙮ, Linear B) are byte-fallback tokens in gemma.
STREAM_TEXT = "Grüße 👋🏽 日本語のテキスト 中文字符 👨‍👩‍👧 🇯🇵 𠜎𠜱𠝹 🫨ꙮ 𐀀 ok"


def _gguf(name):
    return GGUFFile(hub.ensure(name)).metadata


@pytest.fixture(scope="module")
def metadata():
    return {name: _gguf(name) for name in MODELS}


@pytest.fixture(scope="module")
def ours(metadata):
    return {name: Tokenizer.from_gguf(metadata[name]) for name in MODELS}


@pytest.fixture(scope="module", params=MODELS)
def pair(request, ours):
    """(name, kiln tokenizer, transformers tokenizer) for one model."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = hub.ensure(request.param)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return request.param, ours[request.param], ref


# -- exactness against transformers -----------------------------------------------------------


def test_backend_is_the_one_transformers_builds(pair):
    # The whole tokenizers pipeline, vocabulary and merge order included, serialises identically.
    _, tok, ref = pair
    assert json.loads(tok.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())


def test_encode_matches_transformers(pair):
    name, tok, ref = pair
    for text in COMMON + SPECIAL_TEXT[name]:
        assert tok.encode(text) == ref(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"], text


def test_decode_matches_transformers_and_round_trips(pair):
    name, tok, ref = pair
    for text in COMMON + SPECIAL_TEXT[name]:
        ids = ref(text)["input_ids"]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    for text in COMMON:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_bos_eos_and_sizes(ours, metadata):
    smol, gemma = ours["smollm2-135m"], ours["gemma3-270m"]
    assert (smol.bos_id, smol.add_bos, smol.eos_ids, smol.vocab_size) == (1, False, [2], 49152)
    assert (gemma.bos_id, gemma.add_bos, gemma.eos_ids, gemma.vocab_size) == (2, True, [1], 262144)
    assert gemma.encode("hi")[0] == 2 and gemma.encode("hi", add_special_tokens=False)[0] != 2
    assert smol.id_to_token(2) == "<|im_end|>" and smol.token_to_id("<|im_end|>") == 2
    assert gemma.token_to_id("<end_of_turn>") == 106 and gemma.id_to_token(106) == "<end_of_turn>"
    assert gemma.is_byte_token(gemma.token_to_id("<0xE6>")) and not smol.is_byte_token(100)


def test_eot_and_eom_ids_count_as_eos(metadata):
    md = dict(metadata["smollm2-135m"], **{"tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.eom_token_id": 2})
    assert Tokenizer.from_gguf(md).eos_ids == [2, 0]


def test_unsupported_tokenizer_type_is_a_kiln_error(metadata):
    md = dict(metadata["smollm2-135m"], **{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(KilnError, match="unsupported tokenizer type 'rwkv'"):
        Tokenizer.from_gguf(md)


# -- synthetic GGUF files: the tokenizer kinds the two bundled files do not cover -----------------

_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
_SP_TOKENS = ["\u2581", "a", "b", "c", "ab", "\u2581a", "\u2581ab", "bc", "abc", "\u2581abc", "ca", "\u2581b",
              "  ", "\n", "é", "\u2581é"]
# Tied scores on purpose ("abc" ties "ab"): transformers then orders the rebuilt merges by piece lengths.
_SP_SCORES = [-1.0, -2.0, -2.0, -3.0, -4.0, -4.0, -5.0, -5.0, -4.0, -7.0, -5.0, -5.0, -8.0, -9.0, -3.0, -4.0]


def _sentencepiece_case(arch, kind, head, **flags):
    types = [3] * len(head) + [6] * 256 + [1] * 12 + [4, 4, 1, 1]   # "  " and "\n" user-defined
    types[0] = 2
    return dict(arch=arch, kind=kind, tokens=head + _BYTE_TOKENS + _SP_TOKENS, types=types,
                scores=[0.0] * (len(head) + 256) + _SP_SCORES, flags=flags)


def _byte_level_case(pre, **flags):
    from kiln.tokenizer import _bytes_to_unicode

    extra = ["<|endoftext|>", "ab", "Ġa", "Ġab", "12", "<think>", "<｜begin▁of▁sentence｜>", "é", "ĠĠ"]
    return dict(arch="llama", kind="gpt2", tokens=[_bytes_to_unicode()[b] for b in range(256)] + extra,
                types=[1] * 256 + [3, 1, 1, 1, 1, 4, 3, 1, 1], merges=["a b", "Ġ a", "Ġa b", "1 2", "Ġ Ġ"],
                pre=pre, flags=flags, special_ids=(256, 256, 256))


SYNTHETIC = {
    "llama": _sentencepiece_case("llama", "llama", ["<unk>", "<s>", "</s>"], add_add_space_prefix=False),
    "llama-eos": _sentencepiece_case("llama", "llama", ["<unk>", "<s>", "</s>"], add_add_bos_token=False,
                                     add_add_eos_token=True),
    "phi3": _sentencepiece_case("phi3", "llama", ["<unk>", "<s>", "</s>"]),
    "gemma3": _sentencepiece_case("gemma3", "llama", ["<unk>", "<bos>", "<eos>", "<pad>", "<mask>"]),
    "gemma4": _sentencepiece_case("gemma4", "gemma4", ["<unk>", "<bos>", "<eos>", "<pad>", "<mask>"],
                                  add_add_bos_token=True),
    "gpt2-llama-bpe": _byte_level_case("llama-bpe", add_add_eos_token=True),
    "gpt2-qwen2": _byte_level_case("qwen2"),
    "gpt2-default": _byte_level_case("default"),
}
SYNTHETIC_TEXT = ["abc ab  cab bca \u2581x é", "  a\n\nb  ", "<think>ab</think> 12 123 1234",
                  "<s>a</s><|endoftext|><bos>", "éé ab", ""]


def _write_gguf(path, arch, kind, tokens, types, scores=None, merges=None, pre=None, flags=(), special_ids=(0, 1, 2)):
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in [("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", 8),
                       ("add_feed_forward_length", 16), ("add_head_count", 1), ("add_head_count_kv", 1),
                       ("add_layer_norm_rms_eps", 1e-5), ("add_vocab_size", len(tokens)),
                       ("add_tokenizer_model", kind), ("add_token_list", tokens), ("add_token_types", types),
                       ("add_unk_token_id", special_ids[0]), ("add_bos_token_id", special_ids[1]),
                       ("add_eos_token_id", special_ids[2]), *dict(flags).items()]:
        getattr(w, add)(value)
    for add, value in [("add_tokenizer_pre", pre), ("add_token_scores", scores), ("add_token_merges", merges)]:
        if value is not None:
            getattr(w, add)(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", list(SYNTHETIC))
def test_synthetic_gguf_matches_transformers(case, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    _write_gguf(tmp_path / "t.gguf", **SYNTHETIC[case])
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    tok = Tokenizer.from_gguf(GGUFFile(tmp_path / "t.gguf").metadata)
    assert json.loads(tok.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in SYNTHETIC_TEXT:
        ids = ref(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids), text
    assert tok.special_tokens == ref.special_tokens_map


# -- HF directory -------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["smollm2-135m"], indirect=True)
def test_hf_dir_matches_gguf(tmp_path, ours, pair):
    _, _, ref = pair
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in COMMON + SPECIAL_TEXT["smollm2-135m"]:
        assert tok.encode(text) == ref(text)["input_ids"], text
    assert tok.chat_template == ref.chat_template == ours["smollm2-135m"].chat_template
    assert tok.eos_ids == [2, 0] and tok.bos_id == 1 and not tok.add_bos

    # The legacy spelling: the template as a named list inside tokenizer_config.json.
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_hf_dir_without_tokenizer_json_is_a_kiln_error(tmp_path):
    with pytest.raises(KilnError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_named_templates_are_public_and_read_only(tmp_path):
    """A folder's default template and its extra ones (additional_chat_templates/NAME.jinja), by
    name; apply_chat_template renders "tool_use" when it is given tools."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    Backend(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.from_hf_dir(tmp_path).templates == {}
    (tmp_path / "chat_template.jinja").write_text("plain")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | length }} tools")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.templates == {"default": "plain", "tool_use": "{{ tools | length }} tools"}
    assert tok.chat_template == tok.templates["default"]
    conv = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conv) == "plain" and tok.apply_chat_template(conv, tools=[{}]) == "1 tools"
    with pytest.raises(TypeError):
        tok.templates["default"] = "changed"


# -- chat templates -------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Bonjour ? 日本"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3?"},
    ],
]


@pytest.mark.parametrize("pair", ["smollm2-135m"], indirect=True)   # gemma 3 base has no template
def test_chat_template_matches_transformers(pair):
    _, tok, ref = pair
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == want
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_no_chat_template_is_a_kiln_error(ours):
    assert ours["gemma3-270m"].chat_template is None
    with pytest.raises(KilnError, match="no chat template"):
        ours["gemma3-270m"].apply_chat_template(CONVERSATIONS[0])


def _with_template(metadata, template):
    return Tokenizer.from_gguf(dict(metadata["smollm2-135m"], **{"tokenizer.chat_template": template}))


def test_template_errors_are_kiln_errors(metadata):
    with pytest.raises(KilnError, match="malformed chat template"):
        _with_template(metadata, "{% for m in messages %}{{ m.content }}").apply_chat_template(CONVERSATIONS[0])
    raising = _with_template(
        metadata, "{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}")
    with pytest.raises(KilnError, match="need a system turn"):
        raising.apply_chat_template(CONVERSATIONS[0])


def test_template_environment_like_transformers(metadata):
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ messages[0] | tojson(indent=1) }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}"
        "{{ strftime_now('%Y') | length }}|{{ custom }}|{{ documents is none }}"
        "{% if add_generation_prompt %}GO{% endif %}"
    )
    tok = _with_template(metadata, template)
    tools = [{"name": "f", "description": "<ü>"}]
    messages = [{"role": "user", "content": "é<&>", "tool_calls": None}, {"role": "user", "content": "x"}]
    out = tok.apply_chat_template(messages, tools=tools, custom=7)
    first = json.dumps({"role": "user", "content": "é<&>"}, ensure_ascii=False, indent=1)
    assert out == f'<|im_start|>|<|im_end|>|{json.dumps(tools, ensure_ascii=False)}|{first}[é<&>]4|7|TrueGO'
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("|True")


# -- streaming ----------------------------------------------------------------------------------


def _pieces(tok, ids, prompt_ids=None):
    decoder = StreamDecoder(tok, prompt_ids)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("name", MODELS)
def test_stream_decoder_emits_whole_characters(ours, name):
    tok = ours[name]
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False)
    # The text must really split characters across tokens, or this test proves nothing.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _pieces(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == STREAM_TEXT
    assert sum(1 for p in pieces if p) > len(STREAM_TEXT.split()), "text should stream, not arrive at the end"


def test_stream_decoder_on_invalid_byte_runs(ours):
    # A byte that turns a finished character invalid again: gemma decodes a <0xNN> run as one unit.
    tok = ours["gemma3-270m"]
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xA9, 0xE6)]
    for ids in (byte[:2] + [byte[2]] + tok.encode(" ok", False), byte + tok.encode("a", False), byte[:2]):
        assert "".join(_pieces(tok, ids)) == tok.decode(ids), ids
    smol = ours["smollm2-135m"]
    lone = [smol.token_to_id("Ã")] + smol.encode("x", False)   # a lead byte with no continuation
    assert "".join(_pieces(smol, lone)) == smol.decode(lone)


def test_stream_decoder_drops_an_incomplete_character_at_the_end(ours):
    """A generation cut inside a character ends without it (held back for good, as mid-stream), not
    in U+FFFD; the complete characters before it in the same token or byte run still come out."""
    smol = ours["smollm2-135m"]
    head, cut = smol.encode("、アニュラグ", False), smol.encode("ア", False)
    assert len(cut) > 1 and smol.decode(head + cut[:1]).endswith("\ufffd")   # the output
    assert "".join(_pieces(smol, head + cut[:1])) == "、アニュラグ"
    gemma = ours["gemma3-270m"]
    ok = gemma.encode("ok ", False)
    # the lead bytes whose second byte is restricted (E0, ED, F0, F4) and a complete "é" before a cut
    for tail, want in ([0xE6], ""), ([0xE6, 0x97], ""), ([0xC3, 0xA9, 0xE6], "é"), ([0xE0], ""), \
            ([0xED], ""), ([0xF0, 0x9F], ""), ([0xF4], ""):
        ids = ok + [gemma.token_to_id(f"<0x{b:02X}>") for b in tail]
        pieces = _pieces(gemma, ids)
        assert "".join(pieces) == "ok " + want and not any("\ufffd" in p for p in pieces), tail


@pytest.mark.parametrize("name", MODELS)
def test_stream_decoder_keeps_invalid_bytes_and_real_replacement_chars_at_the_end(ours, name):
    """Only an incomplete character is dropped: a byte that no continuation can make valid, or a
    U+FFFD the model wrote, is text."""
    tok = ours[name]
    ids = tok.encode("x \ufffd", False)
    assert "".join(_pieces(tok, ids)) == tok.decode(ids) == "x \ufffd"
    stray = tok.token_to_id("<0xA9>" if name == "gemma3-270m" else "©")   # a lone continuation byte
    ids = tok.encode("x", False) + [stray]
    assert "".join(_pieces(tok, ids)) == tok.decode(ids) == "x\ufffd"


@pytest.mark.parametrize("name", MODELS)
def test_stream_decoder_with_prompt_context(ours, name):
    tok = ours[name]
    prompt = tok.encode("The answer is", add_special_tokens=False)
    ids = tok.encode("The answer is forty-two 🎉", add_special_tokens=False)[len(prompt):]
    assert "".join(_pieces(tok, ids, prompt)) == " forty-two 🎉"


# -- cache ----------------------------------------------------------------------------------------


def test_cache_round_trip_and_corrupt_file(tmp_path, monkeypatch, metadata, ours):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    md = metadata["smollm2-135m"]
    first = Tokenizer.from_gguf(md, cache_key="abc")
    cached = tmp_path / "tokenizers" / f"abc-v{tokenizer_module.BUILD_VERSION}.json"
    assert cached.is_file() and not list(cached.parent.glob("*.tmp"))
    text = COMMON[5]
    again = Tokenizer.from_gguf(md, cache_key="abc")
    assert again.encode(text) == first.encode(text) == ours["smollm2-135m"].encode(text)
    cached.write_text("{ not json")
    assert Tokenizer.from_gguf(md, cache_key="abc").encode(text) == first.encode(text)
    assert json.loads(cached.read_text())["model"]["type"] == "BPE"   # rebuilt and rewritten
    shutil.rmtree(tmp_path / "tokenizers")
