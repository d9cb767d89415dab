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


def _logits(backend: str, ids: list[int], steps: list[int]):
    import kiln

    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cpu", dtype="f32", backend=backend)
    eng = llm.engine
    eng.prefill_chunk = 16                    # several chunks: later ones attend to the cached prefix
    state = eng.new_state(len(ids) + len(steps))
    out = [eng.prefill(ids, state)]
    for k, tok in enumerate(steps):
        out.append(eng.decode_step(tok, len(ids) + k, state))
    return llm, torch.stack(out)


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
