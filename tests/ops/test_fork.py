"""ops.fork / ops.join (kiln/ops/fork.py): a layer's two branches at once. Off the GPU, and for a
prefill chunk, fork runs its function in order; on the GPU at decode the branch runs on a side stream,
and a model decodes the same tokens, to the bit the same logits, as with every branch in order
(KILN_FORK=0): the same kernels, only their overlap differs."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.backends.cuda import CudaOps
from kiln.backends.reference import ReferenceOps
from kiln.ops.fork import FORK_ROWS, Forked, join, peek
from kiln.ops.gemm import gemm
from kiln.ops.moe import kernels as moe_kernels


def test_off_the_gpu_fork_runs_in_order_and_join_returns_the_value():
    calls = []

    def fn():
        calls.append(1)
        return torch.ones(2)

    for ops in (ReferenceOps("cpu"), CudaOps.__new__(CudaOps)):
        v = ops.fork(fn, torch.zeros(1, 4))
        assert calls and not isinstance(v, Forked)
        assert torch.equal(ops.join(v), torch.ones(2)) and peek(v) is v
        calls.clear()
    assert join(3) == 3


class StubStream:
    """Stands in for a CUDA stream off the GPU: records the waits a join makes."""

    def __init__(self):
        self.waited = []

    def wait_stream(self, other):
        self.waited.append(other)


@pytest.mark.parametrize("gemv", [True, False])
def test_a_forked_shared_expert_is_joined_and_combined_as_a_plain_one(gemv, monkeypatch):
    """The cuda backend's gated MoE (under the interpreter) with the shared expert as a fork's result:
    joined once (main waits on the side stream), and the same values to the bit as with the plain
    tensor (the same kernels in the same order: the GEMV form joins between its GEMVs and the
    combine, the grouped form first)."""
    shape = moe_kernels.MoeShape(3, 8, 2, 32, 16, "silu")
    gen = torch.Generator().manual_seed(7)
    i = moe_kernels.moe_inputs(shape, torch.bfloat16, torch.device("cpu"), gen)
    gate_w = torch.randn(1, shape.h, generator=gen).to(torch.bfloat16)
    shared = torch.randn(shape.rows, shape.h, generator=gen).to(torch.bfloat16)
    ops = CudaOps("cpu")
    if gemv:
        form = moe_kernels.gemv_variant(16, 16, 4)
        monkeypatch.setattr(ops, "choose", lambda op, s: form if op is moe_kernels.OP else op.default(s, ops.dev))
    args = (i["x"], i["idx"], i["weights"], i["gate_up"], i["down"], i["act"], gate_w)
    want = ops.moe_experts_gated(*args, shared)
    main = StubStream()
    forked = Forked(shared, side="side", main=main)
    got = ops.moe_experts_gated(*args, forked)
    assert forked.joined and main.waited == ["side"]
    assert torch.equal(got, want)


def logits_and_tokens(name: str, monkeypatch, fork: str, eager: bool):
    monkeypatch.setenv("KILN_FORK", fork)
    llm = kiln.load(name, device="cuda", dtype="bf16", enforce_eager=eager)
    prompt = [(7 * i + 3) % 300 for i in range(24)]
    out = llm.generate(prompt, max_new_tokens=10, temperature=0).token_ids
    # The decode step captured, not fallen back to eager steps (both modes would then agree trivially).
    # (The tiny 4-bit model's prefill graph still falls back: its experts' prefill is the reference's
    # per-expert loop, a host read, where the fused kernels do not take its tiny dims.)
    assert eager or not llm.engine.graph.failed
    with torch.inference_mode():
        state = llm.engine.new_state(64)
        llm.engine.prefill(prompt, state)
        logits = [llm.engine.decode_step(t, len(prompt) + j, state).float().cpu() for j, t in enumerate(out[:4])]
    return out, torch.stack(logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["synth:tiny-gemma4-moe", "synth:tiny-qwen3.5-moe",
                                  "synth:tiny-qwen3.5-moe-p2:bits=4"])
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_forked_branches_decode_what_the_branches_in_order_decode(name, eager, monkeypatch):
    want_tokens, want = logits_and_tokens(name, monkeypatch, "0", eager)
    got_tokens, got = logits_and_tokens(name, monkeypatch, "1", eager)
    assert got_tokens == want_tokens
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_forks_split_k_kernels_count_arrivals_apart_from_the_main_streams():
    """Split-K GEMVs on both streams at once: each stream's arrival counters are its own (one shared
    buffer lets one kernel's arrivals finish another's tiles)."""
    ops = CudaOps("cuda")
    x = torch.randn(1, 64, device="cuda")
    main_buf = gemm.arrival_counters(x.device, 16)
    side_buf = ops.join(ops.fork(lambda: gemm.arrival_counters(x.device, 16), x))
    assert side_buf.data_ptr() != main_buf.data_ptr()
    assert gemm.arrival_counters(x.device, 16).data_ptr() == main_buf.data_ptr()
    again = ops.join(ops.fork(lambda: gemm.arrival_counters(x.device, 16), x))
    assert again.data_ptr() == side_buf.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fork_runs_beside_the_main_stream_and_join_orders_it():
    ops = CudaOps("cuda")
    x = torch.randn(1, 256, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    v = ops.fork(lambda: (big @ big).sum(0, keepdim=True) + x[:, :1], x)
    assert isinstance(v, Forked) and v.side != torch.cuda.current_stream()
    got = ops.join(v)
    want = (big @ big).sum(0, keepdim=True) + x[:, :1]
    torch.testing.assert_close(got, want)
    rows = torch.randn(FORK_ROWS + 1, 8, device="cuda")    # a prefill chunk: in order
    assert not isinstance(ops.fork(lambda: rows * 2, rows), Forked)
