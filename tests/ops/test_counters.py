"""The arrival-counter buffers a CUDA graph captures by address are never freed when a wider launch
replaces them (kiln/ops/counters.py): on CPU, the replaced buffer is still referenced; on the GPU, a
captured batched GDN step replays right, and leaves alone the small tensors allocated after its
counters were replaced (the memory a freed buffer would have gone to)."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

pytest.importorskip("triton")

import kiln.ops.gdn.cuda  # noqa: E402,F401 - installs the keeping counters
import kiln.ops.gemm.cuda  # noqa: E402,F401
from kiln.ops.gdn import kernels as gdn_kernels  # noqa: E402
from kiln.ops.gemm import gemm  # noqa: E402

from .test_batched_decode import SLOTS, gdn_rows_case  # noqa: E402

KEEPING = os.environ.get("KILN_KEEP_COUNTERS", "1") != "0"


@pytest.mark.skipif(not KEEPING, reason="KILN_KEEP_COUNTERS=0: the old behaviour, on purpose")
@pytest.mark.parametrize("module", [gemm, gdn_kernels], ids=["gemm", "gdn"])
def test_a_replaced_counter_buffer_stays_alive(module):
    dev = torch.device("cpu")
    first = module.arrival_counters(dev, 1)
    size, ref, addr = first.numel(), weakref.ref(first), first.data_ptr()
    del first
    grown = module.arrival_counters(dev, size + 1)
    gc.collect()
    assert grown.numel() > size and grown.data_ptr() != addr
    assert ref() is not None and ref().data_ptr() == addr


@pytest.mark.skipif(not KEEPING, reason="KILN_KEEP_COUNTERS=0: the old behaviour, on purpose")
def test_a_side_streams_swapped_buffer_is_kept_and_the_swaps_add_nothing():
    """ForkOps swaps gemm's counters for the side stream's own around a branch (kiln/ops/fork.py): a
    buffer grown inside the branch keeps the old one alive; repeated swaps keep nothing new."""
    from kiln.ops.fork import ForkOps

    dev, fork = torch.device("cpu"), ForkOps()
    main = gemm.arrival_counters(dev, 1)
    with fork._own_counters(dev):
        side = gemm.arrival_counters(dev, 1)
    assert gemm._COUNTERS[dev] is main and side is not main
    with fork._own_counters(dev):
        grown = gemm.arrival_counters(dev, side.numel() + 1)
    ref, kept = weakref.ref(side), len(gemm._COUNTERS.kept)
    del side
    gc.collect()
    assert ref() is not None and fork._fork_counters is grown and gemm._COUNTERS[dev] is main
    for _ in range(3):
        with fork._own_counters(dev):
            gemm.arrival_counters(dev, 1)
    assert len(gemm._COUNTERS.kept) == kept


def test_setdefault_and_update_keep_what_they_store():
    from kiln.ops.counters import Keeping

    d, a, b = Keeping(), torch.zeros(2), torch.zeros(3)
    d.setdefault("x", a)
    d.update(x=b)
    assert {id(t) for t in d.kept.values()} == {id(a), id(b)} and d["x"] is b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_captured_gdn_step_replays_right_after_its_counters_grow():
    """(With KILN_KEEP_COUNTERS=0 this fails: the reproduction of the serving assert in isolation.)"""
    dev = torch.device("cuda")
    form = gdn_kernels.fused_variant(16, 4, last=True)      # 2 value heads a key head: counted arrivals
    inp, conv, ssm = gdn_rows_case(torch.bfloat16)
    weights = [inp[n] for n in gdn_kernels.ARGS[4:]]
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=dev)

    def step(c, s):
        return gdn_kernels.gdn_decode_rows(inp["qkv"], inp["z"], inp["b"], inp["a"], *weights, c, s, slots,
                                           inp["dims"], form)

    want_conv, want_ssm = conv.clone(), ssm.clone()
    want = [step(want_conv, want_ssm).clone() for _ in range(4)]
    step(conv.clone(), ssm.clone())                    # compiles, allocates the counters
    graph, c, s = torch.cuda.CUDAGraph(), conv.clone(), ssm.clone()
    with torch.cuda.graph(graph):
        y = step(c, s)
    at = inp["qkv"].device           # the kernels' key: cuda:0, not cuda
    old = gdn_kernels.arrival_counters(at, 1)
    gdn_kernels.arrival_counters(at, old.numel() * 16)    # a wider step's: the buffer replaced
    del old
    sentinels = [torch.full((256,), 7, dtype=torch.int32, device=dev) for _ in range(64)]
    got = []
    for _ in range(4):
        graph.replay()
        got.append(y.clone())
    torch.cuda.synchronize()
    assert all(bool((t == 7).all()) for t in sentinels)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(c, want_conv) and torch.equal(s, want_ssm)
