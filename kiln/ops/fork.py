"""Two branches of a layer at once: `ops.fork(fn, x)` queues fn's kernels on a side stream forked from
the current one, so that the kernels queued next on the current stream run beside them; `join(v)`
makes the current stream wait for them and returns fn's result. Gemma 4's dense MLP runs beside its
router and routed experts, Qwen's shared expert beside its router and routed experts: at decode each
branch is a few small, latency-bound kernels, and the GPU fills its idle SMs with the other's.
A fork pays only where its branch is long: the RoPE tables' eight small torch kernels forked beside
Qwen3.5's first linear-attention layers made the 0.8b's decode slower on an H100 (bf16 1,056 against
1,060 tok/s, 4-bit 1,631-1,674 against 1,680-1,696; bench/NOTES.md, 2026-12-06): a join is a full
dependency, so the kernel after it loses its programmatic early launch.

Where the work is large (a prefill chunk) or not on a GPU, fork runs fn at once and returns its
result: join of a plain value is that value. Inside a CUDA graph capture the fork and the join are the
graph's edges. KILN_FORK=0 runs every branch in order (A/B runs).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FORK_ROWS = 64      # decode batches; a prefill chunk's kernels fill the GPU on their own


@dataclass
class Forked:
    value: object                  # fn's result (its tensors written on `side`)
    side: torch.cuda.Stream
    main: torch.cuda.Stream
    joined: bool = False

    def join(self):
        if not self.joined:
            self.main.wait_stream(self.side)
            self.joined = True
        return self.value


def join(v):
    """A fork's result, the current stream waiting for its branch first; a plain value as it is."""
    return v.join() if isinstance(v, Forked) else v


def peek(v):
    """A fork's result without waiting (its shapes and dtypes: host metadata only)."""
    return v.value if isinstance(v, Forked) else v


class ForkOps:
    """The cuda backend's fork (the reference's runs fn in order)."""

    def fork(self, fn, x: torch.Tensor):
        if (x.device.type != "cuda" or x.numel() // max(x.shape[-1], 1) > FORK_ROWS
                or os.environ.get("KILN_FORK", "1") == "0"):
            return fn()
        main = torch.cuda.current_stream(x.device)
        side = self.__dict__.get("_fork_stream")
        if side is None:           # (made by an eager step: a decode graph captures its second)
            side = self._fork_stream = torch.cuda.Stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side), self._own_counters(x.device):
            value = fn()
        return Forked(value, side, main)

    @contextmanager
    def _own_counters(self, device):
        """The side stream's split-K kernels count their arrivals in a buffer of their own: the one
        buffer per device (gemm.arrival_counters) is safe only among kernels of one stream, and a router's
        GEMV on the main stream runs at once with the branch's. (Swapped here rather than keyed by stream
        in gemm.py, whose text is hashed into every shipped GEMM choice.) The first fork, an eager step
        before any capture, allocates it."""
        from .gemm import gemm  # (the reference backend imports this module: no Triton for it)

        saved, mine = gemm._COUNTERS.get(device), self.__dict__.get("_fork_counters")
        if mine is None:
            gemm._COUNTERS.pop(device, None)
        else:
            gemm._COUNTERS[device] = mine
        try:
            yield
        finally:
            self._fork_counters = gemm._COUNTERS.pop(device, None)
            if saved is not None:
                gemm._COUNTERS[device] = saved
