"""Requests decoded together (Engine.decode_batch, kiln.engine.Batch, LLM.generate on a list) give
each request the tokens it gets alone: greedy and seeded sampling, every family, the stops."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.sampling import SamplingParams

FAMILIES = ["synth:tiny-qwen3.5", "synth:tiny-llama", "synth:tiny-gemma3", "synth:tiny-gemma4",
            "synth:tiny-qwen3.5-moe", "synth:tiny-qwen3-next"]


def _prompts(llm, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, llm.model.cfg.vocab_size, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def hybrid():
    return kiln.load("synth:tiny-qwen3.5", device="cpu")


def test_16_greedy_streams_batched_give_the_tokens_of_16_sequential_runs(hybrid):
    prompts = _prompts(hybrid, 16)
    alone = [hybrid.generate(p, max_new_tokens=12) for p in prompts]
    together = hybrid.generate(prompts, max_new_tokens=12)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in alone]
    assert all(len(c.token_ids) == 12 for c in together)


@pytest.mark.parametrize("spec", FAMILIES[1:])
def test_every_family_batches_as_it_runs_alone(spec):
    llm = kiln.load(spec, device="cpu")
    prompts = _prompts(llm, 5, seed=1)
    alone = [llm.generate(p, max_new_tokens=6).token_ids for p in prompts]
    assert [c.token_ids for c in llm.generate(prompts, max_new_tokens=6)] == alone


def test_a_batch_mixing_sampling_settings_matches_each_request_alone(hybrid):
    prompts = _prompts(hybrid, 6, seed=2)
    params = [SamplingParams(max_new_tokens=10),
              SamplingParams(max_new_tokens=7, temperature=0.8, seed=1),
              SamplingParams(max_new_tokens=10, temperature=1.2, top_k=20, seed=2),
              SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=3),
              SamplingParams(max_new_tokens=9, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)]
    alone = [hybrid.generate_batch([p], [s])[0].token_ids for p, s in zip(prompts, params)]
    one_by_one = [hybrid.generate(p, **vars(s)).token_ids for p, s in zip(prompts, params)]
    assert alone == one_by_one      # a batch of one is the single-request loop
    together = hybrid.generate_batch(prompts, params)
    assert [c.token_ids for c in together] == alone
    assert [len(c.token_ids) for c in together] == [10, 7, 10, 4, 9, 10]


def test_the_max_context_ends_a_request_in_a_batch_as_alone():
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu", max_context=24)
    prompts = [[5] * 20, [7] * 3]
    together = llm.generate(prompts, max_new_tokens=10)
    assert [c.finish_reason for c in together] == ["context", "length"]
    assert [c.token_ids for c in together] == [llm.generate(p, max_new_tokens=10).token_ids for p in prompts]


def test_an_eos_ends_only_its_own_request():
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu")
    prompts = _prompts(llm, 4, seed=3)
    first = llm.generate(prompts[0], max_new_tokens=8).token_ids
    llm.eos_ids = [first[2]]         # the third token of request 0 is now an end of sequence
    alone = [llm.generate(p, max_new_tokens=8) for p in prompts]
    together = llm.generate(prompts, max_new_tokens=8)
    assert together[0].finish_reason == "eos" and together[0].token_ids == first[:3]
    assert [(c.token_ids, c.finish_reason) for c in together] == [(c.token_ids, c.finish_reason) for c in alone]


def test_a_stream_read_no_further_leaves_the_batch(hybrid):
    prompts = _prompts(hybrid, 3, seed=4)
    streams = hybrid.engine.generate_batch(prompts, [SamplingParams(max_new_tokens=50) for _ in prompts],
                                           hybrid.eos_ids)
    next(streams[1].ids)
    streams[1].ids.close()           # a client that went away
    rest = [list(s.ids) for s in (streams[0], streams[2])]
    assert all(len(r) == 50 for r in rest)
    assert streams[1].times.generated_tokens < 5      # decoded no further once closed


def test_a_list_of_text_prompts_on_a_real_model_with_a_stop_string():
    llm = kiln.load("smollm2-135m", device="cpu")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    alone = [llm.generate(p, max_new_tokens=16, stop=["\n\n"]) for p in prompts]
    together = llm.generate(prompts, max_new_tokens=16, stop=["\n\n"])
    assert [(c.text, c.token_ids, c.finish_reason) for c in together] == \
        [(c.text, c.token_ids, c.finish_reason) for c in alone]


def test_prompts_and_settings_must_pair_up(hybrid):
    with pytest.raises(kiln.KilnError, match="2 prompts but 1 sampling"):
        hybrid.generate_batch([[1, 2], [3]], [SamplingParams()])


def test_a_long_prompt_joins_in_chunks_while_the_running_streams_go_on():
    from kiln.engine import Batch
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu")
    llm.engine.prefill_chunk = 8
    short, long_ = [3, 1, 4, 1, 5], list(range(10, 50))            # 40 tokens: 5 chunks of 8
    want = [llm.generate(p, max_new_tokens=12).token_ids for p in (short, long_)]
    batch = Batch(llm.engine, set(llm.eos_ids))
    a = batch.add(short, SamplingParams(max_new_tokens=12))
    batch.step()                                                   # a's prompt: one chunk, its first token
    b = batch.add(long_, SamplingParams(max_new_tokens=12))
    for k in range(5):                 # b's five chunks, a decoding beside them (its step's token read at the next)
        batch.step()
        assert len(a.out) == 1 + k and (len(b.out) == 1) == (k == 4)
        assert batch.pending is not None and batch.pending[0] == [a]
    while batch.running and not all(r.done for r in (a, b)):
        batch.step()
    assert [list(a.out), list(b.out)] == want


@pytest.mark.parametrize("spec", ["synth:tiny-qwen3.5", "synth:tiny-gemma4"])
def test_decode_steps_interleaved_in_a_prefill_give_each_request_its_tokens_alone(spec):
    """With `interleave`, decode steps run between the layers of a prompt's prefill chunk (on the CPU
    the step in flight is always finished: one after every layer): the running streams advance
    several tokens a step, and every request still gets its tokens alone, greedy and seeded."""
    from kiln.engine import Batch
    llm = kiln.load(spec, device="cpu")
    llm.engine.prefill_chunk = 8
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(10, 50))]
    params = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, temperature=0.8, seed=7),
              SamplingParams(max_new_tokens=12)]
    want = [llm.generate(p, **vars(q)).token_ids for p, q in zip(prompts, params)]
    batch = Batch(llm.engine, set(llm.eos_ids), interleave=True)
    a, b = batch.add(prompts[0], params[0]), batch.add(prompts[1], params[1])
    batch.step()
    batch.step()                                   # both prefilled: a decoding, b's first token
    seen = []
    batch.on_tokens = lambda: seen.append(len(a.out))   # a server streams the tokens here
    c = batch.add(prompts[2], params[2])
    before = len(a.out)
    batch.step()                                   # c's first chunk: a decode step after each layer
    assert len(a.out) - before >= 2 and len(b.out) >= 2
    assert len(seen) == len(a.out) - before - 1 and seen == sorted(seen)
    while not all(r.done for r in (a, b, c)):
        batch.step()
    assert [list(r.out) for r in (a, b, c)] == want
    assert llm.model.between_layers is None


def test_a_request_cancelled_while_it_prefills_leaves_the_batch_whole():
    """A server drains tokens between a prefill's layers and may cancel there the very request that
    is prefilling (its client left): the batch drops it, gives its pool slot back (the cuda backend
    pools batched state, here under the interpreter), and the others run on to their lengths."""
    from kiln.engine import Batch
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="cuda", dtype="f32")
    eng = llm.engine
    eng.prefill_chunk = 8
    prompts = [[3, 1, 4, 1, 5], list(range(10, 50)), [2, 7, 1, 8]]
    # each prompt's first token comes from its own prefill, the same kernels as alone; later tokens
    # come from batched steps whose row count changes the products' order, so only lengths are held
    first = [llm.generate(p, max_new_tokens=1).token_ids for p in (prompts[0], prompts[2])]
    batch = Batch(eng, set(llm.eos_ids), slots=2, interleave=True)
    a = batch.add(prompts[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    batch.step()
    b, c = (batch.add(p, SamplingParams(max_new_tokens=3, ignore_eos=True)) for p in prompts[1:])
    calls = []
    batch.on_tokens = lambda: (calls.append(1), batch.cancel(b))
    batch.step()                                   # b's first chunk: cancelled inside it, after its first layer
    batch.on_tokens = None
    assert len(calls) == 1                         # its other layers (and their decode steps) never ran
    assert b.done and b.cancelled and b.state is None and list(batch.waiting) == [c]
    assert batch.lent == 1 and len(batch.pool.free) == 1      # a's slot lent, b's back
    while not (a.done and c.done):
        batch.step()
    assert [list(a.out)[:1], list(c.out)[:1]] == first and (len(a.out), len(c.out)) == (12, 3)
    assert b not in batch.running
    assert batch.lent == 0 and len(batch.pool.free) == 2


@pytest.mark.parametrize("spec", ["synth:tiny-qwen3.5", "synth:tiny-llama"])
def test_a_prefix_cached_in_the_batch_gives_each_request_its_tokens_alone(spec):
    """A batch with a prefix cache: requests sharing 64+ prompt tokens start from the kept state (the
    GDN states of a hybrid model too) and prefill the rest, with the tokens each gets alone in a
    batch of its own (whose prefill also stops at the kept boundary, so both sum in one order)."""
    from kiln.engine import PREFIX_BLOCK, Batch
    llm = kiln.load(spec, device="cpu")
    shared = [(5 * j) % 300 + 1 for j in range(PREFIX_BLOCK + 9)]
    prompts = [shared + [7, 8, 9], shared + [11], shared[:PREFIX_BLOCK - 1] + [4, 4], shared + [7, 8, 9, 10, 12]]
    want = [list(Batch(llm.engine, set(), prefix_cache=True).add(p, SamplingParams(max_new_tokens=6)).stream.ids)
            for p in prompts]
    assert all(len(w) == 6 for w in want)
    batch = Batch(llm.engine, set(), prefix_cache=True)
    one_by_one = []
    for p in prompts:                   # one after another: each finds what the ones before kept
        r = batch.add(p, SamplingParams(max_new_tokens=6))
        one_by_one.append((list(r.stream.ids), r.stream.times.cached_tokens))
    assert one_by_one == list(zip(want, [0, PREFIX_BLOCK, 0, PREFIX_BLOCK]))
    together = Batch(llm.engine, set(), prefix_cache=True)       # all at once: prefilled in turn
    got = [together.add(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    assert [list(r.stream.ids) for r in got] == want
    assert [r.stream.times.cached_tokens for r in got] == [0, PREFIX_BLOCK, 0, PREFIX_BLOCK]


def test_ignore_eos_runs_to_max_new_tokens_alone_and_batched(hybrid, monkeypatch):
    """ignore_eos (vLLM's field, for fixed-length benchmarks): an end-of-sequence token no longer ends
    the request, alone or in a batch; without it the same token does."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = hybrid.generate(prompt, max_new_tokens=6).token_ids
    monkeypatch.setattr(hybrid, "eos_ids", [free[1]])
    stopped = hybrid.generate(prompt, max_new_tokens=6)
    assert stopped.token_ids == free[:2] and stopped.finish_reason == "eos"
    assert hybrid.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids == free
    both = hybrid.generate_batch([prompt, prompt], [SamplingParams(max_new_tokens=6),
                                                    SamplingParams(max_new_tokens=6, ignore_eos=True)])
    assert [c.token_ids for c in both] == [free[:2], free]


# -- several prompts in one prefill forward (Engine.prefill_rows, Batch(group_prefill=True)) ----------
@pytest.mark.parametrize("spec,backend", [("synth:tiny-qwen3.5", "reference"), ("synth:tiny-llama", "reference"),
                                          ("synth:tiny-gemma3", "reference"), ("synth:tiny-qwen3.5-moe", "reference"),
                                          ("synth:tiny-gemma4", "reference"), ("synth:tiny-gemma4-moe", "reference"),
                                          ("synth:tiny-qwen3.5", "cuda")])
def test_prompts_prefilled_together_give_each_ones_logits_and_state_alone(spec, backend):
    """Ragged prompts (one of a single token) prefilled in one forward, in two parts from their own
    offsets: each one's last-row logits and the state it leaves (its next decode step) are those of
    the prompt prefilled alone, to f32 rounding (the products' row count differs); on the reference
    backend and the cuda backend's kernels (under the interpreter)."""
    llm = kiln.load(spec, device="cpu", dtype="f32", backend=backend)
    eng = llm.engine
    prompts = _prompts(llm, 4, seed=5) + [[7]]
    alone, states = [], []
    for p in prompts:
        states.append(eng.new_state(64))
        alone.append(eng.prefill(p, states[-1]))
    together = [eng.new_state(64) for _ in prompts]
    half = [len(p) // 2 for p in prompts]
    eng.prefill_rows([(p[:h], s, 0) for p, h, s in zip(prompts, half, together) if h])
    got = eng.prefill_rows([(p[h:], s, h) for p, h, s in zip(prompts, half, together)])
    assert got.shape == (len(prompts), llm.model.cfg.vocab_size)
    for j, p in enumerate(prompts):
        torch.testing.assert_close(got[j], alone[j], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng.decode_step(5, len(p), together[j]), eng.decode_step(5, len(p), states[j]),
                                   rtol=1e-4, atol=1e-4)


def _counting_rows(monkeypatch, eng) -> list[int]:
    calls: list[int] = []
    rows = eng.prefill_rows
    monkeypatch.setattr(eng, "prefill_rows", lambda parts: (calls.append(len(parts)), rows(parts))[1])
    return calls


def test_a_burst_of_prompts_is_prefilled_in_forwards_that_fit_the_chunk(hybrid, monkeypatch):
    """Prompts waiting together join the oldest one's forward while their whole prompts fit the
    chunk's token budget; one that does not waits for its own. Each gets its first token from it,
    the one it gets alone, and runs to its length."""
    from kiln.engine import Batch
    eng = hybrid.engine
    monkeypatch.setattr(eng, "prefill_chunk", 16)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 1], [4, 4]]
    alone = [eng.prefill(p, eng.new_state(16)) for p in prompts]
    calls = _counting_rows(monkeypatch, eng)
    batch = Batch(eng, set(), group_prefill=True)
    got = [batch.add(p, SamplingParams(max_new_tokens=5)) for p in prompts]
    batch.step()                       # 5 + 9 tokens fit 16; the next 7 do not
    assert calls == [2] and [len(r.out) for r in got] == [1, 1, 0, 0]
    batch.step()                       # 7 + 2
    assert calls == [2, 2] and [len(r.out) for r in got[2:]] == [1, 1]
    while not all(r.done for r in got):
        batch.step()
    assert all(len(r.out) == 5 for r in got)
    for r, logits in zip(got, alone):     # its first token alone, unless the top two are within rounding
        top2 = logits.topk(2)
        near_tie = top2.values[0] - top2.values[1] < 1e-3
        assert r.out[0] == int(top2.indices[0]) or (near_tie and r.out[0] == int(top2.indices[1]))


def test_requests_sharing_a_cached_prefix_are_not_prefilled_beside_each_other(monkeypatch):
    """With the prefix cache, a prompt sharing a first block with one in the forward being gathered
    waits for it, and starts from the state it keeps (a burst of chats with one system prompt)."""
    from kiln.engine import PREFIX_BLOCK, Batch
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu")
    shared = [(5 * j) % 300 + 1 for j in range(PREFIX_BLOCK + 9)]
    prompts = [[8, 8, 8], shared + [7, 8, 9], [6, 6], shared + [11]]
    calls = _counting_rows(monkeypatch, llm.engine)
    batch = Batch(llm.engine, set(), prefix_cache=True, group_prefill=True)
    got = [batch.add(p, SamplingParams(max_new_tokens=3)) for p in prompts]
    while not all(r.done for r in got):
        batch.step()
    assert [r.stream.times.cached_tokens for r in got] == [0, 0, 0, PREFIX_BLOCK]
    assert calls and all(len(r.out) == 3 for r in got)


def test_a_request_cancelled_inside_a_shared_prefill_leaves_the_others_theirs():
    """A server may cancel, between the layers of a forward prefilling several prompts, one of them:
    the forward goes on for the others (it stops only when all of them are cancelled), which get
    their first tokens; the cancelled one gets none and leaves the batch."""
    from kiln.engine import Batch
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [2, 7, 1, 8]]
    batch = Batch(llm.engine, set(), interleave=True, group_prefill=True)
    a = batch.add(prompts[0], SamplingParams(max_new_tokens=20))
    batch.step()
    b, c = (batch.add(p, SamplingParams(max_new_tokens=3)) for p in prompts[1:])
    batch.on_tokens = lambda: batch.cancel(b)
    batch.step()                                   # b and c in one forward; b cancelled after its first layer
    batch.on_tokens = None
    assert b.cancelled and not b.out and len(c.out) == 1 and not batch.waiting
    both = [batch.add(p, SamplingParams(max_new_tokens=3)) for p in prompts[1:]]
    layers = []
    batch.on_tokens = lambda: (layers.append(1), [batch.cancel(r) for r in both])
    batch.step()                                   # both cancelled: the forward stops after one layer
    assert len(layers) == 1 and all(r.cancelled and not r.out for r in both)
    batch.on_tokens = None
    while not (a.done and c.done):
        batch.step()
    assert len(a.out) == 20 and len(c.out) == 3
