"""The decode step as one CUDA graph (kiln/backends/graphs.py): on the GPU, replayed it gives the
tokens of the same kernels run eagerly; a capture that fails warns once and decodes eagerly; and the
pipelined greedy loop (DecodeGraph.greedy_tokens, fed by the step's own greedy choice) gives the
host's argmax loop's tokens. On CPU the runner's capture is made to fail, so each step runs the
graph's body (the reference backend's ops)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kiln
from kiln.backends import graphs
from kiln.cache import PAGE


def assert_f32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """f32 logits of the same math over another row count: a product may sum in another order (the
    kernel or BLAS path picked by the rows), so within 1e-4 of the largest value, as the cuda-vs-
    reference test (tests/backends/test_cuda.py) bounds it."""
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_graph_gives_the_eager_tokens_and_counts_launches():
    """The decode step replayed as a CUDA graph gives the tokens of the same kernels run eagerly,
    across two requests on the one persistent state (the second replays the first's graph)."""
    prompt = [(11 * i + 5) % 300 for i in range(40)]
    eager = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cuda", dtype="bf16", enforce_eager=True)
    want = eager.generate(prompt, max_new_tokens=12, temperature=0).token_ids
    graph = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cuda", dtype="bf16")
    assert graph.engine.graph is not None
    for _ in range(2):
        assert graph.generate(prompt, max_new_tokens=12, temperature=0).token_ids == want
    assert graph.engine.graph.captures == 1
    assert graph.engine.launches_per_token is None or graph.engine.launches_per_token > 0


def test_a_failed_capture_warns_once_and_decodes_eagerly(monkeypatch, capsys):
    """A decode step that cannot be captured (an op that is not graph-safe) must not fail the request:
    the graph runner restores the layers' lengths, warns once, and runs every later step eagerly."""
    llm = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")   # KV buffers that stay put
    model, eng = llm.model, llm.engine
    runner = graphs.DecodeGraph(model, torch.device("cpu"))

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "_capture", broken)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ids = [5, 9, 77, 3]
    ours, plain = eng.new_state(16), eng.new_state(16)
    eng.prefill(ids, ours)
    eng.prefill(ids, plain)
    tokens = [11, 12, 13]
    for k, tok in enumerate(tokens):
        got = runner.step(tok, len(ids) + k, ours)
        want = eng.decode_step(tok, len(ids) + k, plain)
        assert torch.equal(got, want)
    assert runner.failed and runner.graph is None
    assert [layer.length for layer in ours] == [layer.length for layer in plain]
    assert capsys.readouterr().err.count("could not be captured") == 1


def _runner_and_states(monkeypatch):
    llm = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")
    runner = graphs.DecodeGraph(llm.model, torch.device("cpu"))
    monkeypatch.setattr(runner, "_capture", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no graphs")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return llm.engine, runner


def test_pipelined_greedy_tokens_equal_the_host_loop_and_count_what_was_fed(monkeypatch):
    """The device-fed loop (here the CPU runner: eager steps, reference argmax) gives the host loop's
    tokens; a consumer that stops after 3 tokens leaves two more steps run, and `fed` lists every
    token the state was fed, so the layers' lengths match it."""
    eng, runner = _runner_and_states(monkeypatch)
    ids = [5, 9, 77, 3]
    ours, plain = eng.new_state(32), eng.new_state(32)
    first = int(torch.argmax(eng.prefill(ids, ours)))
    assert first == int(torch.argmax(eng.prefill(ids, plain)))
    want, tok = [], first
    for k in range(8):
        tok = int(torch.argmax(eng.decode_step(tok, len(ids) + k, plain)))
        want.append(tok)
    fed: list[int] = []
    assert list(runner.greedy_tokens(first, len(ids), ours, 8, fed)) == want
    assert fed == [first] + want[:7] and ours[0].length == len(ids) + 8

    again = eng.new_state(32)
    eng.prefill(ids, again)
    fed = []
    stream = runner.greedy_tokens(first, len(ids), again, 8, fed)
    assert [next(stream) for _ in range(3)] == want[:3]
    stream.close()
    assert fed == [first] + want[:4] and again[0].length == len(ids) + len(fed)


def test_greedy_generate_gives_the_sampler_paths_tokens(monkeypatch):
    """generate() in greedy mode runs the pipelined loop: the same tokens as the sampler path (a
    repetition penalty of 1 + tiny epsilon is never exactly 1, so it takes the host loop)."""
    llm = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")
    prompt = [5, 9, 77, 3, 41]
    fast = llm.generate(prompt, max_new_tokens=10, temperature=0).token_ids
    slow = llm.generate(prompt, max_new_tokens=10, temperature=0, repetition_penalty=1.0 + 1e-9).token_ids
    assert fast == slow and len(fast) == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["synth:tiny-qwen3.5-moe-p2", "synth:qwen3.5-0.8b"])
def test_gpu_batched_steps_replayed_as_graphs_give_the_eager_tokens(spec):
    """Batched decode steps over the slot pool, replayed as one CUDA graph per batch bucket, give the
    tokens of the same steps run eagerly: requests joining and leaving, so buckets change."""
    from kiln.engine import Batch

    llm = kiln.load(spec, device="cuda", dtype="bf16", max_batch=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 7, 23, 64, 5)]
    budgets = [12, 3, 9, 12, 6]

    def run(interleave=False, launches=None):
        batch = Batch(llm.engine, set(), slots=4, interleave=interleave)
        if launches is not None:    # (rows, launched from inside a prefill's layer hook)
            launch = batch._launch
            batch._launch = lambda live: (launches.append((len(live), batch._in_step)), launch(live))
        requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
        return [list(r.stream.ids) for r in requests]

    eng = llm.engine
    graphed = run()
    assert eng._batch_graphs is not None and eng._batch_graphs.captures > 0 and not eng._batch_graphs.failed
    # decode steps between prefill layers: which rows share a step depends on timing, and a bucket's
    # tiles may round differently, so only what does not depend on it is compared: the first token
    # (the prompt's), the lengths, every decode row launched once; and some steps ran inside prefills
    # (a host-bound prefill of 24 layers against a ~1 ms step)
    launches = []
    graphs_on, eng.prefill_graphs = eng.prefill_graphs, None   # a prompt prefilled as a graph has no layer hook
    mixed = run(interleave=True, launches=launches)
    eng.prefill_graphs = graphs_on
    assert [t[:1] for t in mixed] == [t[:1] for t in graphed] and list(map(len, mixed)) == budgets
    assert sum(rows for rows, _ in launches) == sum(budgets) - len(budgets)
    assert any(inside for _, inside in launches)
    eng._batch_graphs = None
    assert run() == graphed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batched_graphs_capture_again_when_the_rows_pass_their_key_span():
    """A batched step's graph reads each slot's first StateBatch.keys rows (key_span of the rows'
    positions); a row passing that span gets the step captured again with the next span, and the
    tokens stay those of the eager steps."""
    from kiln.cache import KEY_SPAN_MIN
    from kiln.engine import Batch

    llm = kiln.load("synth:qwen3.5-0.8b", device="cuda", dtype="bf16", max_batch=2,   # (tiny models: 1,024 positions)
                    max_context=2 * KEY_SPAN_MIN)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist() for n in (KEY_SPAN_MIN - 5, 9)]

    def run():   # (no decode steps inside the prefill: which rows share a step then depends on timing)
        batch = Batch(llm.engine, set(), slots=2, interleave=False)
        requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=12)) for p in prompts]
        return [list(r.stream.ids) for r in requests]

    eng = llm.engine
    graphed = run()
    graphs = eng._batch_graphs
    assert list(map(len, graphed)) == [12, 12]
    assert not graphs.failed and graphs.graphs[2][0] == 2 * KEY_SPAN_MIN    # the two rows' step, past 2,048
    assert graphs.captures >= 2
    eng._batch_graphs = None
    assert run() == graphed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_batchs_prompts_prefilled_as_slot_graphs_replay_their_first_run():
    """A batch's fresh prompts, each prefilled alone, run as prefill graphs on the pool
    (PrefillGraphs.run_slot): a bucket's first prompt runs eagerly and is captured, the next ones
    replay; a second batch of the same prompts (every bucket replayed, on other slots) gives the
    same tokens as the first."""
    from kiln.engine import Batch

    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cuda", dtype="bf16", max_batch=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist() for n in (40, 7, 45, 64, 5)]

    def run():
        batch = Batch(llm.engine, set(), slots=4, group_prefill=False)   # grouped prompts run eagerly
        requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=8)) for p in prompts]
        return [list(r.stream.ids) for r in requests]

    first = run()
    runner = llm.engine.prefill_graphs
    assert runner is not None and not runner.failed and runner.captures == 3     # buckets 48, 16, 64
    assert run() == first and runner.captures == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_prompt_split_where_the_prefix_cache_keeps_its_state_prefills_its_first_part_as_a_graph():
    """With the prefix cache (as the server runs), a prompt is prefilled up to its last block boundary,
    its state kept there, then the rest: the first part, from position 0, runs as a slot graph; the
    rest, at position 64, runs eagerly the first time its (bucket, position) comes and as a graph
    from the second (the prompt repeated, started from the kept state), replayed the third time
    with the tokens of the second."""
    from kiln.engine import Batch

    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cuda", dtype="bf16", max_batch=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist() for n in (100, 90)]
    batch = Batch(llm.engine, set(), slots=4, prefix_cache=True, group_prefill=False)
    for r in [batch.add(p, kiln.SamplingParams(max_new_tokens=6)) for p in prompts]:
        assert len(list(r.stream.ids)) == 6
    runner = llm.engine.prefill_graphs
    assert not runner.failed and runner.captures == 1          # both cut at 64: one bucket from 0
    again, tokens = [], []
    for _ in range(2):                  # one after the other: each decodes alone, as the first did
        again.append(batch.add(prompts[0], kiln.SamplingParams(max_new_tokens=6)))
        tokens.append(list(again[-1].stream.ids))
    assert runner.captures == 2 and tokens[0] == tokens[1]     # the rest at 64: captured, then replayed
    assert all(r.stream.times.cached_tokens == 64 for r in again)


def test_prefill_buckets_round_up_to_an_eighth_of_the_power_of_two():
    runner = graphs.PrefillGraphs(None, torch.device("cpu"), 4096)
    got = {n: runner.bucket(n) for n in (1, 16, 17, 100, 128, 129, 512, 513, 1000, 4096)}
    assert got == {1: 16, 16: 16, 17: 32, 100: 112, 128: 128, 129: 160, 512: 512, 513: 640, 1000: 1024,
                   4096: 4096}
    assert runner.bucket(4097) is None


@pytest.mark.parametrize("model", ["synth:tiny-qwen3.5-moe-p2", "synth:tiny-gemma4-moe-p2"])
def test_a_padded_prefill_gives_the_prompts_logits_state_and_tokens(model, monkeypatch):
    """What a prefill graph captures (PrefillGraphs._body: the prompt padded to its bucket, the GDN
    layers told its length), run here on the cuda backend under the interpreter: the logits of the
    prompt's last row and the decode steps after it equal those of the prompt prefilled alone (the
    spare rows' K/V lie past the prompt, where decode overwrites them), to f32 rounding."""
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    llm = kiln.load(model, device="cpu", dtype="f32", backend="cuda")
    eng = llm.engine
    runner = graphs.PrefillGraphs(llm.model, torch.device("cpu"), 512)
    ids = [(7 * i + 3) % 397 for i in range(21)]
    b = runner.bucket(len(ids))
    assert b == 32
    alone, padded = eng.new_state(64), eng.new_state(64)
    want = [eng.prefill(ids, alone)]
    got = [runner._body(padded, torch.tensor(ids + [1] * (b - len(ids))), torch.tensor([len(ids)]))[0]]
    runner._set_length(padded, len(ids))
    for k, tok in enumerate([5, 300, 42]):
        want.append(eng.decode_step(tok, len(ids) + k, alone))
        got.append(eng.decode_step(tok, len(ids) + k, padded))
    assert_f32_close(torch.stack(got), torch.stack(want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["synth:tiny-qwen3.5-moe-p2", "synth:tiny-gemma4-moe-p2"])
def test_gpu_prefill_graph_replays_the_padded_forward(model):
    """A prompt's first prefill runs the padded forward and captures it; the next one of its bucket
    replays the graph: the same logits as the padded forward run eagerly on a fresh state, the same
    greedy tokens as the first request, and the lengths of the prompt."""
    llm = kiln.load(model, device="cuda", dtype="bf16")
    eng, prompt = llm.engine, [(11 * i + 5) % 300 for i in range(40)]
    first = llm.generate(prompt, max_new_tokens=8, temperature=0).token_ids
    assert eng.prefill_graphs is not None and eng.prefill_graphs.captures == 1
    assert llm.generate(prompt, max_new_tokens=8, temperature=0).token_ids == first
    with torch.inference_mode():        # as the engine runs (the state was made inside it)
        state = eng.new_state(64)
        replayed = eng.prefill(prompt, state)
        assert eng.prefill_graphs.captures == 1 and all(layer.length == 40 for layer in state)
        b = eng.prefill_graphs.bucket(40)
        eager = eng.prefill_graphs._body(eng.new_state(64), torch.tensor(prompt + [0] * (b - 40), device="cuda"),
                                         torch.tensor([40], device="cuda"))[0]
    assert torch.equal(replayed, eager)


def _fake_capture(monkeypatch) -> None:
    """CUDA graph capture faked on CPU: the capture runs its body eagerly, a replay does nothing."""
    class FakeGraph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)


@pytest.mark.parametrize("start", [0, 13])
def test_a_slot_prefill_fills_the_requests_slot_as_an_eager_prefill(start, monkeypatch):
    """run_slot (its forward run, then captured; the capture emulated) on the cuda backend under the
    interpreter: a prompt's part from `start`, prefilled through the pool's scratch slot (given the
    slot's first `start` K/V rows and GDN states) and copied into its own slot, gives the logits and
    decode steps of the same part prefilled eagerly into another slot; stale contents of the
    request's slot (from 0) or of the scratch slot are overwritten, and the scratch is left empty. A
    later part's (bucket, offset) runs the first time as the caller's, from the second as a graph."""
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cpu", dtype="f32", backend="cuda")
    eng = llm.engine
    pool = eng.slot_pool(3)
    runner = graphs.PrefillGraphs(llm.model, torch.device("cpu"), 512)
    _replaying_capture(monkeypatch, runner)     # (a capture that ran its body would feed the part twice)
    ids = [(7 * i + 3) % 300 for i in range(21)]
    alone, slotted = pool.take(), pool.take()
    for layer in (pool.scratch if start else slotted):   # stale contents: the copies must overwrite them
        if hasattr(layer, "pool_k"):                      # the slot's pages, through its block table
            rows = layer.rows(0, pool.held(layer.slot) * PAGE)
            for store in (layer.pool_k, layer.pool_v):
                store.index_fill_(0, rows, 7.0)
        else:
            for t in (layer.conv, layer.ssm):
                t.fill_(7.0)
    if start:
        eng.prefill(ids[:start], alone)
        eng.prefill(ids[:start], slotted)
        assert runner.run_slot(ids[start:], slotted, pool, start) is None and runner.captures == 0
    want = [eng.prefill(ids[start:], alone, offset=start)]
    got = [runner.run_slot(ids[start:], slotted, pool, start)]
    assert runner.captures == 1 and {layer.length for layer in slotted} == {21}
    assert {layer.length for layer in pool.scratch} == {0}
    for k, tok in enumerate([5, 200, 42]):
        want.append(eng.decode_step(tok, 21 + k, alone))
        got.append(eng.decode_step(tok, 21 + k, slotted))
    assert_f32_close(torch.stack(got), torch.stack(want))


def _replaying_capture(monkeypatch, runner) -> list:
    """PrefillGraphs' capture emulated on CPU: the 'graph' re-runs the body on its input buffers at
    each replay and copies the result into the captured output, as a replay refills it; the capture
    itself runs nothing. Returns the list of (bucket, replays) seen."""
    replays = []

    class Replaying:
        def __init__(self, body, inputs, out, key):
            self.body, self.inputs, self.out, self.key = body, inputs, out, key

        def replay(self):
            replays.append(self.key[0])
            self.out.copy_(self.body(*self.inputs))

    def capture(key, inputs, body, state, start, quiet):
        out = torch.empty_like(runner._last)     # shaped as the eager run's logits
        runner.graphs[key] = (Replaying(body, inputs, out, key), out, *inputs)
        runner.captures += 1

    run = runner._run

    def remembering(key, ids, b, extra, body, state, start, quiet):
        def kept(*a):
            runner._last = body(*a)
            return runner._last
        return run(key, ids, b, extra, kept, state, start, quiet)

    monkeypatch.setattr(runner, "_capture", capture)
    monkeypatch.setattr(runner, "_run", remembering)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    return replays


def test_a_batch_with_the_prefix_cache_prefills_through_slot_graphs_as_without(monkeypatch):
    """The server's path on CPU (the cuda backend with its kernel families off: the plumbing, not the
    kernels, which the tests above cover), graph replays emulated. With the prefix cache each prompt
    is cut at its last 64-token boundary: the part before it runs as a slot graph from position 0
    (replayed for the next prompt of its bucket); the rest, at position 64, runs eagerly the first
    time its (bucket, position) comes, is captured the second time and replayed the third (a
    repeated prompt, started from the kept state). Every request gets the tokens of the same batch
    run without graphs."""
    from kiln.engine import Batch

    monkeypatch.setenv("KILN_KERNELS_OFF", "attention,gdn,moe,gemm,norm,rope")   # the plumbing, not the kernels
    llm = kiln.load("synth:tiny-qwen3.5-moe", device="cpu", dtype="f32", backend="cuda")
    eng = llm.engine
    g = torch.Generator().manual_seed(3)
    # lengths whose parts fill their buckets (64 + 16, 32): the same row counts with or without graphs,
    # so the same sums in the same order
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (80, 80, 32, 32)]
    prompts.append(prompts[0])

    def run():
        batch = Batch(eng, set(), slots=3, prefix_cache=True, interleave=False, group_prefill=False)
        requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=3)) for p in prompts]
        return [list(r.stream.ids) for r in requests], requests

    want, _ = run()
    eng.prefill_graphs = runner = graphs.PrefillGraphs(llm.model, torch.device("cpu"), 512)
    replays = _replaying_capture(monkeypatch, runner)
    got, requests = run()
    assert got == want
    assert runner.captures == 3 and sorted(replays) == [16, 32, 64]     # 64 at 0, 16 at 64, 32 at 0
    assert requests[-1].stream.times.cached_tokens == 64
