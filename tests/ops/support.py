"""Helpers for the norm and gemm kernel tests (no tests here): seeded inputs and the rounding check
that a kernel equals its reference op."""

from __future__ import annotations

import torch

from kiln.backends.reference import ReferenceOps

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = ReferenceOps(DEVICE)
DTYPES = [torch.float32, torch.bfloat16]
STYLES = ["llama", "offset", "plain"]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype=dtype, device=DEVICE)


def assert_rounding_close(got: torch.Tensor, want: torch.Tensor, exact_fraction: float = 0.98):
    """Within one unit in the last place of the output dtype, and mostly bit-equal: the kernels
    round where the reference rounds; only the summation order differs."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:   # f32 sums in another order: relative to the largest value
        assert err.max().item() <= 1e-5 * want.abs().max().item() + 1e-6, err.max().item()
        return
    ulp = want.float().abs().clamp_min(1e-3) * torch.finfo(want.dtype).eps
    assert (err <= ulp + 1e-6).all(), f"{(err / ulp).max().item():.2f} ulp"
    assert (got == want).float().mean().item() >= exact_fraction


def captured(step):
    """(CUDA graph of step(), what step() returned while captured): step runs once on a side stream
    first, as torch asks before a capture (lazy allocations, autotuning, arrival counters)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
