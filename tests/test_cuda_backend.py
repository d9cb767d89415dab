"""The cuda backend's whole model against the reference backend on CPU, under Triton's interpreter:
a tiny hybrid MoE model whose head dims let every kernel family run (attention, GDN, MoE, GEMM,
RMSNorm). f32, so the two backends agree to rounding; a chunked prefill then decode steps."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
pytest.importorskip("triton")

from kiln.backends.cuda import A, GDN, MOE, CudaOps  # noqa: E402


def _logits(backend: str, ids: list[int], steps: list[int], dtype: str = "f32"):
    import kiln

    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cpu", dtype=dtype, backend=backend)
    eng = llm.engine
    eng.prefill_chunk = 16                    # several chunks: later ones attend to the cached prefix
    state = eng.new_state(len(ids) + len(steps))
    out = [eng.prefill(ids, state)]
    for k, tok in enumerate(steps):
        out.append(eng.decode_step(tok, len(ids) + k, state))
    return llm, torch.stack(out).float()


@pytest.mark.skipif(None in (A, GDN, MOE), reason="a kernel family is switched off")
def test_cuda_backend_logits_equal_reference_through_prefill_and_decode(monkeypatch):
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")     # each op's default variant: tuning is tested elsewhere
    ids = [(7 * i + 3) % 397 for i in range(37)]
    steps = [5, 300, 42, 17]
    _, ref = _logits("reference", ids, steps)
    llm, got = _logits("cuda", ids, steps)
    assert isinstance(llm.model.ops, CudaOps)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(None in (A, GDN, MOE), reason="a kernel family is switched off")
def test_cuda_backend_in_f16_is_as_close_to_the_reference_as_f16_allows(monkeypatch):
    """--dtype f16 runs the same kernels: the cuda backend's f16 logits are no farther from the
    reference backend's f16 than those are from f32 (the rounding points are the same; only the
    accumulation order differs), and every argmax agrees."""
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    ids = [(7 * i + 3) % 397 for i in range(37)]
    steps = [5, 300, 42, 17]
    _, exact = _logits("reference", ids, steps)
    _, ref = _logits("reference", ids, steps, "f16")
    _, got = _logits("cuda", ids, steps, "f16")
    f16_noise = (ref - exact).abs().max() / exact.abs().max()
    assert (got - ref).abs().max() / ref.abs().max() <= f16_noise
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_graph_gives_the_eager_tokens_and_counts_launches():
    """The decode step replayed as a CUDA graph gives the tokens of the same kernels run eagerly,
    across two requests on the one persistent state (the second replays the first's graph)."""
    import kiln

    prompt = [(11 * i + 5) % 397 for i in range(40)]
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
    import kiln
    from kiln import graphs

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


def test_gemma3_on_the_cuda_backend_keeps_plain_caches_and_the_reference_tokens(monkeypatch):
    """Sliding-window layers on the cuda backend keep a plain KV buffer (the window is masked in
    attention), so the decode step can be a CUDA graph; tokens equal the reference's ring caches."""
    import kiln
    from kiln.cache import KVCache, RingKVCache

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    prompt = [(5 * i + 2) % 317 for i in range(11)]       # longer than the window of 7
    ref = kiln.load("synth:tiny-gemma3", device="cpu", dtype="f32")
    assert any(isinstance(s, RingKVCache) for s in ref.model.make_state(torch.float32, "cpu"))
    llm = kiln.load("synth:tiny-gemma3", device="cpu", dtype="f32", backend="cuda")
    assert all(isinstance(s, KVCache) for s in llm.model.make_state(torch.float32, "cpu"))
    want = ref.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    assert llm.generate(prompt, max_new_tokens=6, temperature=0).token_ids == want


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-gemma4-moe"])
def test_gemma4_on_the_cuda_backend_keeps_plain_caches_and_the_reference_tokens(monkeypatch, name):
    """As Gemma 3: plain KV buffers for the sliding layers (so Gemma 4's decode step can be a graph),
    the reference's tokens past the window."""
    import kiln
    from kiln.cache import KVCache, RingKVCache

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    prompt = [(5 * i + 2) % 300 for i in range(13)]       # longer than the windows (7, 9)
    ref = kiln.load(f"synth:{name}", device="cpu", dtype="f32")
    assert any(isinstance(s, RingKVCache) for s in ref.model.make_state(torch.float32, "cpu"))
    llm = kiln.load(f"synth:{name}", device="cpu", dtype="f32", backend="cuda")
    assert all(isinstance(s, KVCache) for s in llm.model.make_state(torch.float32, "cpu"))
    want = ref.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    assert llm.generate(prompt, max_new_tokens=6, temperature=0).token_ids == want
