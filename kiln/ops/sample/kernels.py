"""Greedy decoding on the device: the next token chosen inside the decode step's CUDA graph.

`greedy_next(logits, ids, pos)` writes argmax(logits) into `ids` and adds one to `pos`: the graph's
own inputs for the next step, so the host can queue step n + 1 before it has read token n (the
engine's pipelined greedy loop) and never has to fill them. Ties go to the lowest index, as
torch.argmax; a NaN counts as +inf (torch would return the NaN's index: a model writing NaN logits
is broken either way).

Kernel: P programs each scan a contiguous span for its (max, first index), store the pair, and
arrive at a counter; the last to arrive reduces the P pairs in program order (the same winner
whoever is last), writes the outputs and resets the counter (CUDA graph replays included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ..common import cdiv, pdl, pdl_wait

BLOCK = 2048          # logits a program reads per iteration
MAX_PROGRAMS = 128    # spans of ~2k logits at a 248k vocabulary: about one wave of a large GPU


@triton.jit
def greedy_kernel(x_ptr, ids_ptr, pos_ptr, val_ptr, idx_ptr, count_ptr, V, SPAN, P: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    pdl_wait(PDL)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.full((BLOCK,), 2147483647, tl.int32)
    start = pid * SPAN
    for off in range(0, SPAN, BLOCK):
        i = start + off + tl.arange(0, BLOCK)
        valid = (i < V) & (off + tl.arange(0, BLOCK) < SPAN)
        x = tl.load(x_ptr + i, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        # strict: an earlier index of the same lane keeps a tie; a lane's first logit is always taken
        # (all -inf logits still give an index, as torch.argmax's 0)
        take = valid & ((x > best) | (where == 2147483647))
        best = tl.where(take, x, best)
        where = tl.where(take, i, where)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, where, 2147483647), axis=0)
    tl.store(val_ptr + pid, m)
    tl.store(idx_ptr + pid, first)
    # NOTE: every thread's stores before the release; the last arrival's acquire sees all pairs.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == P - 1:
        j = tl.arange(0, P)
        vals = tl.load(val_ptr + j, cache_modifier=".cg")
        idxs = tl.load(idx_ptr + j, cache_modifier=".cg")
        mm = tl.max(vals, axis=0)
        tok = tl.min(tl.where(vals == mm, idxs, 2147483647), axis=0)   # spans ascend: lowest index wins
        tl.store(ids_ptr, tok.to(tl.int64))
        tl.store(pos_ptr, tl.load(pos_ptr) + 1)
        tl.atomic_xchg(count_ptr, 0)


_WORK: dict[torch.device, tuple] = {}


def _workspace(device: torch.device) -> tuple:
    """Partials and the arrival counter, per device. NOTE: allocated by the eager step before a graph
    is captured over them (a capture cannot allocate them)."""
    if device not in _WORK:
        _WORK[device] = (torch.empty(MAX_PROGRAMS, dtype=torch.float32, device=device),
                         torch.empty(MAX_PROGRAMS, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device))
    return _WORK[device]


def programs(vocab: int, device: torch.device) -> int:
    """A power of two (the final reduce is one tl.arange), at most one per SM and per BLOCK logits."""
    cap = min(MAX_PROGRAMS, device_info(device).sms if not interpreting() else 8, cdiv(vocab, BLOCK))
    return 1 << (max(cap, 1).bit_length() - 1)


def greedy_next(logits: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> None:
    """ids[0] = argmax(logits) (first index of the max), pos[0] += 1; logits [V] contiguous, ids and
    pos one-element int64 tensors on the same device."""
    assert logits.dim() == 1 and logits.is_contiguous() and ids.dtype == pos.dtype == torch.int64
    v = logits.shape[0]
    p = programs(v, logits.device)
    vals, idxs, count = _workspace(logits.device)
    span = cdiv(cdiv(v, p), BLOCK) * BLOCK
    greedy_kernel[(p,)](logits, ids, pos, vals, idxs, count, v, span, P=p, BLOCK=BLOCK, **pdl(logits))
