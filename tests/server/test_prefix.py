"""Prefix reuse in the engine (what `kiln serve` turns on): greedy tokens with reuse equal tokens
without it, cached counts are exact, layers that cannot rewind (sliding-window rings) start fresh,
and the default `Engine.generate` keeps no state between requests."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

import kiln
from kiln.cache import WindowKVCache
from kiln.models import model_class
from kiln.models.base import config_from_dict
from kiln.sampling import SamplingParams


def _random_model(path, config: dict, **load):
    """An HF folder of random weights in the shapes kiln's model file declares (no transformers needed)."""
    cls = model_class(config["model_type"])
    cfg = config_from_dict(cls.config_class, config)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=gen) * (1.0 if len(shape) == 1 else 0.3)
               for name, shape in cls.weight_shapes(cfg).items() if name not in cls.tied_names(cfg)}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return kiln.load(str(path), device="cpu", dtype="f32", **load)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _random_model(tmp_path_factory.mktemp("llama"), dict(
        model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))


GEMMA3 = dict(model_type="gemma3_text", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=5, max_position_embeddings=512,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=32)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _random_model(tmp_path_factory.mktemp("gemma3"), GEMMA3)


def _generate(llm, ids, reuse, n=8):
    stream = llm.engine.generate(ids, SamplingParams(max_new_tokens=n), [], reuse=reuse)
    return list(stream.ids), stream.times.cached_tokens


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _prompts(seed=0):
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(300) for _ in range(n)]  # noqa: E731
    base = ids(40)
    return [base, base + ids(7), base[:25] + ids(9), base[:25] + ids(3), ids(12), ids(12)[:1] + base]


def test_greedy_tokens_with_reuse_equal_tokens_without(llama):
    llama.engine._kept = None
    consumed = None
    for ids in _prompts():
        fresh, none_cached = _generate(llama, ids, reuse=False)
        reused, cached = _generate(llama, ids, reuse=True)
        assert reused == fresh and none_cached == 0
        expected = 0 if consumed is None else min(_lcp(consumed, ids), len(ids) - 1)
        assert cached == expected, (cached, expected)
        consumed = ids + reused  # ended by length: the engine fed the last token too


def test_the_same_prompt_twice_reuses_all_but_its_last_token(llama):
    ids = _prompts(1)[0]
    first, _ = _generate(llama, ids, reuse=True)
    again, cached = _generate(llama, ids, reuse=True)
    assert again == first and cached == len(ids) - 1


def test_a_chat_turn_that_extends_the_last_answer_reuses_all_of_it(llama):
    ids = _prompts(2)[0]
    answer, _ = _generate(llama, ids, reuse=True)
    follow = ids + answer + [7, 8, 9]
    out, cached = _generate(llama, follow, reuse=True)
    # The last sampled token is never fed through the model, so the state holds all but it.
    assert cached == len(ids) + len(answer) - 1
    assert out == _generate(llama, follow, reuse=False)[0]


def test_sliding_window_layers_reuse_only_what_they_still_hold(gemma3):
    gemma3.engine._kept = None
    ids = _prompts(3)[0]
    answer, _ = _generate(gemma3, ids, reuse=True)
    # Extending exactly what the state consumed: every layer, rings included, can go on from there.
    follow = ids + answer + [5, 6]
    out, cached = _generate(gemma3, follow, reuse=True)
    assert cached == len(ids) + len(answer) - 1 and out == _generate(gemma3, follow, reuse=False)[0]
    # Branching earlier would need keys the rings dropped: the engine starts fresh.
    branch = ids[:30] + [1, 2, 3]
    out, cached = _generate(gemma3, branch, reuse=True)
    assert cached == 0 and out == _generate(gemma3, branch, reuse=False)[0]


def test_the_cuda_backends_window_rings_rewind_while_they_hold_the_window(tmp_path, monkeypatch):
    """On the cuda backend (under the interpreter) the sliding layers keep rings of 32 rows here
    (kiln.cache.WindowKVCache: window 5 - 1 + a prefill chunk of 8, in key blocks of 32). After a
    40-token prompt and 8 tokens the rings hold positions 16..47: a prompt branching at 30 rewinds
    them (its window, 26..29, is still held), one branching at 10 starts fresh (6..9 were
    overwritten). The tokens are those of the same prompts run without reuse."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    llm = _random_model(tmp_path, GEMMA3, backend="cuda")
    llm.model.ops.prefill_chunk = llm.engine.prefill_chunk = 8
    ids = _prompts(3)[0]
    for keep, rewinds in ((30, True), (10, False)):
        _generate(llm, ids, reuse=True)         # the kept state: the prompt and its answer, 47 positions
        rings = [s for s in llm.engine._kept.state if isinstance(s, WindowKVCache)]
        assert len(rings) == 2 and all(r.ring_rows == 32 and r.length == 47 for r in rings)
        branch = ids[:keep] + [1, 2, 3]
        out, cached = _generate(llm, branch, reuse=True)
        assert cached == (keep if rewinds else 0)
        assert out == _generate(llm, branch, reuse=False)[0]


def test_default_generate_keeps_no_state(llama):
    llama.engine._kept = None
    assert not llama.engine.reuse_prefix
    ids = _prompts(4)[0]
    llama.generate(ids, max_new_tokens=4)
    llama.generate(ids, max_new_tokens=4)
    assert llama.engine._kept is None
    stream = llama.engine.generate(ids, SamplingParams(max_new_tokens=3), [])
    list(stream.ids)
    assert stream.times.cached_tokens == 0 and llama.engine._kept is None


def test_the_reuse_flag_turns_it_on_for_every_caller(llama):
    llama.engine._kept = None
    ids = _prompts(5)[0]
    try:
        llama.engine.reuse_prefix = True
        a = llama.generate(ids, max_new_tokens=4)
        b = llama.generate(ids, max_new_tokens=4)
    finally:
        llama.engine.reuse_prefix = False
        llama.engine._kept = None
    assert a.token_ids == b.token_ids
    assert llama.engine._kept is None


def test_a_stream_whose_state_was_taken_over_stops(llama):
    ids = _prompts(6)[0]
    old = llama.engine.generate(ids, SamplingParams(max_new_tokens=8), [], reuse=True)
    next(old.ids)
    _generate(llama, ids[:20] + [1, 2], reuse=True)  # rewinds and reuses the same state
    with pytest.raises(RuntimeError, match="taken over"):
        next(old.ids)
