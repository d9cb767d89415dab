"""The engine's one decode loop against a plain host loop over prefill and decode_step (the
specification): the same tokens, finish reasons and counts for every token source (greedy, greedy
with a repetition penalty, sampled), with eos, length and max-context stops, eager and on the
CUDA-graph path (here the CPU graph runner: its capture fails, so each step runs the graph's body)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.backends import graphs
from kiln.engine import GraphState
from kiln.sampling import Sampler, SamplingParams

PROMPT = [(7 * i + 3) % 331 for i in range(11)]
KINDS = {"greedy": dict(temperature=0), "penalty": dict(temperature=0, repetition_penalty=1.3),
         "sampled": dict(temperature=0.9, top_k=50, top_p=0.95, seed=7)}


def _engine(graph: bool, monkeypatch):
    eng = kiln.load("synth:tiny-llama", device="cpu", dtype="f32").engine
    if graph:
        runner = graphs.DecodeGraph(eng.model, torch.device("cpu"))
        monkeypatch.setattr(runner, "_capture", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no graphs")))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        eng.graph = runner
    return eng


def _host_loop(eng, prompt: list[int], params: SamplingParams, eos: set[int]) -> tuple[list[int], str]:
    """Choose a token from each step's logits; feed it back only if another token will be read."""
    state = eng.model.make_state(eng.dtype, eng.device)
    sampler, fed = Sampler(params, eng.device), list(prompt)
    logits, out = eng.prefill(prompt, state), []
    while True:
        out.append(sampler(logits, torch.tensor(fed)))
        if out[-1] in eos:
            return out, "eos"
        if len(out) == params.max_new_tokens:
            return out, "length"
        if len(fed) + 1 >= eng.max_context:
            return out, "context"
        logits = eng.decode_step(out[-1], len(fed), state)
        fed.append(out[-1])


def _generate(eng, prompt, params, eos):
    stream = eng.generate(prompt, params, eos)
    return list(stream.ids), stream.finish_reason, stream.times


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_gives_the_host_loops_tokens_and_finish(kind, graph, monkeypatch):
    eng = _engine(graph, monkeypatch)
    params = SamplingParams(max_new_tokens=12, **KINDS[kind])
    want, _ = _host_loop(eng, PROMPT, params, set())
    stops = {"length": set(), "eos": {want[4]}, "eos first": {want[0]}}
    for name, eos in stops.items():
        tokens, finish, times = _generate(eng, PROMPT, params, eos)
        assert (tokens, finish) == _host_loop(eng, PROMPT, params, eos), name
        assert times.generated_tokens == len(tokens) and times.prompt_tokens == len(PROMPT)
        assert times.prefill_s > 0 and times.decode_s >= 0
    eng.max_context = len(PROMPT) + 5                   # the context ends before max_new_tokens
    tokens, finish, _ = _generate(eng, PROMPT, params, set())
    assert (tokens, finish) == (want[:5], "context")
    assert isinstance(eng.new_state(8), GraphState) == graph


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_stream_closed_early_leaves_its_state_reusable(graph, monkeypatch):
    """A consumer that stops after 3 greedy tokens: the state holds what it was fed (on the graph
    path one step more: the pipelined loop runs ahead of the reads), so a follow-up prompt reuses
    exactly that much and gets the tokens of a fresh start."""
    eng = _engine(graph, monkeypatch)
    params = SamplingParams(max_new_tokens=12)
    stream = eng.generate(PROMPT, params, [], reuse=True)
    got = [next(stream.ids) for _ in range(3)]
    stream.ids.close()
    follow = PROMPT + got + [1]
    stream = eng.generate(follow, params, [], reuse=True)
    assert list(stream.ids) == _host_loop(eng, follow, params, set())[0]
    assert stream.times.cached_tokens == len(PROMPT) + (3 if graph else 2)


def test_decode_steps_replay_the_graph_only_on_its_own_state(monkeypatch):
    eng = _engine(True, monkeypatch)
    calls = []
    run = eng.graph.run
    monkeypatch.setattr(eng.graph, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    ours, plain = eng.new_state(16), eng.model.make_state(eng.dtype, eng.device)
    assert isinstance(ours, GraphState) and not isinstance(plain, GraphState)
    first = int(torch.argmax(eng.prefill(PROMPT, ours)))
    eng.prefill(PROMPT, plain)
    want = list(eng.greedy_tokens(first, len(PROMPT), plain, 4))
    assert not calls
    assert list(eng.greedy_tokens(first, len(PROMPT), ours, 4)) == want and len(calls) == 4
    pos = len(PROMPT) + 4
    assert torch.equal(eng.decode_step(want[-1], pos, ours), eng.decode_step(want[-1], pos, plain))
    assert len(calls) == 5


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_request_that_does_not_reuse_ends_what_a_later_one_could_reuse(graph, monkeypatch):
    """On the graph path every request runs on the one persistent state: a non-reusing request in
    between overwrites what the last reusing one left there, so the next reusing request must start
    fresh (the tokens of a fresh start), not resume from that state."""
    eng = _engine(graph, monkeypatch)
    params = SamplingParams(max_new_tokens=6)
    first = list(eng.generate(PROMPT, params, [], reuse=True).ids)
    other = [(5 * i + 1) % 331 for i in range(40)]     # longer than the prefix: the state could "rewind" to it
    list(eng.generate(other, params, [], reuse=False).ids)
    follow = PROMPT + first + [2]
    stream = eng.generate(follow, params, [], reuse=True)
    assert list(stream.ids) == _host_loop(eng, follow, params, set())[0]
    assert stream.times.cached_tokens == (0 if graph else len(PROMPT) + len(first) - 1)


def test_a_kv_cache_grows_by_doubling_up_to_the_max_context_only():
    from kiln.cache import KVCache
    cache = KVCache(2, 8, torch.float32, "cpu")
    kv = torch.randn(257, 2, 8)
    cache.update(kv, kv, torch.arange(257))
    assert cache.capacity == 512              # doubling, with no limit set
    capped = KVCache(2, 8, torch.float32, "cpu")
    capped.limit = 300
    capped.update(kv, kv, torch.arange(257))
    assert capped.capacity == 300
    llm = kiln.load("synth:tiny-llama", device="cpu", max_context=300)
    state = llm.engine.new_state(10)
    assert [layer.limit for layer in state if hasattr(layer, "limit")] == [300] * 3
