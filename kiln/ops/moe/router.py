"""The routers after their projection, one launch each: Qwen's (ReferenceOps.router_topk: softmax in f32,
the k largest, optionally renormalised, in the logits' dtype; one launch instead of torch's 6) and
Gemma 4's (MoeReference.scaled_topk: renormalised, times per_expert_scale[id]; the weights stay f32);
at decode, either with its projection in the same launch (router_gemv_topk_kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import SUPPORTED, next_pow2, pdl, pdl_wait, rne_flag, round_to
from ..gemm.gemm import arrival_counters
from ..gemm.helpers import last_arrival

MAX_EXPERTS = 1024   # one program holds a row of logits
FUSED_ROWS = 2       # the fused router's last program runs the rows' top-k one after another
FUSED_WIDTH = 8192   # ... and each program holds a whole weight row


@triton.jit
def softmax_topk(l_ptr, t, E: tl.constexpr, EP: tl.constexpr, KTOP: tl.constexpr, KP: tl.constexpr):
    """Row t of the logits: the reference's softmax in f32 (exp(x - max) / sum), then the k largest in
    descending order, a tie to the lower id -> (top [KP] f32, ids [KP] int32, slots; 0 past k)."""
    e = tl.arange(0, EP)
    x = tl.load(l_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    work = tl.where(e < E, p, -1.0)          # padding is never chosen (p >= 0)
    slots = tl.arange(0, KP)
    top = tl.zeros((KP,), dtype=tl.float32)
    idx = tl.zeros((KP,), dtype=tl.int32)
    for j in tl.static_range(KTOP):
        best = tl.max(work, axis=0)
        first = tl.min(tl.where(work == best, e, EP), axis=0)
        top = tl.where(slots == j, best, top)
        idx = tl.where(slots == j, first, idx)
        work = tl.where(e == first, -2.0, work)
    return top, idx, slots


@triton.jit
def router_kernel(l_ptr, w_ptr, i_ptr, E: tl.constexpr, EP: tl.constexpr, KTOP: tl.constexpr,
                  KP: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """Row t: softmax_topk, renormalised by the f32 sum of the k (RENORM), cast to w's dtype."""
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    top, idx, slots = softmax_topk(l_ptr, t, E, EP, KTOP, KP)
    if RENORM:
        top = top / tl.sum(top, axis=0)      # slots past k hold 0
    tl.store(w_ptr + t * KTOP + slots, top.to(w_ptr.dtype.element_ty), mask=slots < KTOP)
    tl.store(i_ptr + t * KTOP + slots, idx.to(tl.int64), mask=slots < KTOP)


@triton.jit
def scaled_topk_kernel(l_ptr, s_ptr, w_ptr, i_ptr, E: tl.constexpr, EP: tl.constexpr, KTOP: tl.constexpr,
                       KP: tl.constexpr, PDL: tl.constexpr = False):
    """Row t: softmax_topk, top / sum(top), then times the chosen experts' scales."""
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    top, idx, slots = softmax_topk(l_ptr, t, E, EP, KTOP, KP)
    top = top / tl.sum(top, axis=0)          # slots past k hold 0
    scale = tl.load(s_ptr + idx, mask=slots < KTOP, other=0.0).to(tl.float32)
    tl.store(w_ptr + t * KTOP + slots, top * scale, mask=slots < KTOP)
    tl.store(i_ptr + t * KTOP + slots, idx.to(tl.int64), mask=slots < KTOP)


@triton.jit(do_not_specialize=["T"])
def router_gemv_topk_kernel(x_ptr, w_ptr, s_ptr, l_ptr, count_ptr, wo_ptr, io_ptr, T, E: tl.constexpr,
                            EP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, KTOP: tl.constexpr,
                            KP: tl.constexpr, RNE: tl.constexpr, SCALED: tl.constexpr = True,
                            RENORM: tl.constexpr = True, PDL: tl.constexpr = False):
    """A router at decode in one launch: program e computes expert e's logit of each of the T rows (its
    weight row loaded before the wait: the projection streams in while the kernel before finishes),
    rounded to the logits' dtype as the reference's linear; the last program to arrive runs the top-k
    on the rows and resets the counter: SCALED, Gemma 4's (scaled_topk_kernel's steps), else Qwen's
    (router_kernel's: renormalised if RENORM, cast to wo's dtype)."""
    e = tl.program_id(0)
    cols = tl.arange(0, HP)
    live = cols < H
    w = tl.load(w_ptr + e.to(tl.int64) * H + cols, mask=live, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    for row in range(0, T):
        x = tl.load(x_ptr + row * H + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(l_ptr + row * E + e, round_to(tl.sum(w * x, axis=0), l_ptr.dtype.element_ty, RNE))
    if last_arrival(count_ptr, 0, E):
        for t64 in range(0, T):
            t = tl.cast(t64, tl.int64)
            top, idx, slots = softmax_topk(l_ptr, t, E, EP, KTOP, KP)
            if SCALED:
                top = top / tl.sum(top, axis=0)
                top = top * tl.load(s_ptr + idx, mask=slots < KTOP, other=0.0).to(tl.float32)
            elif RENORM:
                top = top / tl.sum(top, axis=0)      # slots past k hold 0
            tl.store(wo_ptr + t * KTOP + slots, top.to(wo_ptr.dtype.element_ty), mask=slots < KTOP)
            tl.store(io_ptr + t * KTOP + slots, idx.to(tl.int64), mask=slots < KTOP)
        tl.atomic_xchg(count_ptr, 0)


def supports(logits, expert_scale, k: int) -> bool:
    return (logits.dim() == 2 and logits.dtype in SUPPORTED and logits.shape[1] <= MAX_EXPERTS
            and k <= logits.shape[1] and expert_scale.shape == logits.shape[1:])


def scaled_topk(logits: torch.Tensor, expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], expert_scale [E] -> (weights [T, k] f32, ids [T, k] int64)."""
    t, e = logits.shape
    logits = logits.contiguous()
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((t, k), dtype=torch.long, device=logits.device)
    if t:
        scaled_topk_kernel[(t,)](logits, expert_scale.contiguous(), w, idx, E=e, EP=next_pow2(e), KTOP=k,
                                 KP=next_pow2(k), num_warps=4, **pdl(logits))
    return w, idx


def router_topk(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """ReferenceOps.router_topk in one launch: logits [T, E] -> (weights [T, k] logits' dtype, ids [T, k] int64)."""
    t, e = logits.shape
    logits = logits.contiguous()
    w = torch.empty((t, k), dtype=logits.dtype, device=logits.device)
    idx = torch.empty((t, k), dtype=torch.long, device=logits.device)
    if t:
        router_kernel[(t,)](logits, w, idx, E=e, EP=next_pow2(e), KTOP=k, KP=next_pow2(k), RENORM=renormalize,
                            num_warps=4, **pdl(logits))
    return w, idx


def fused_supports(x, proj, expert_scale, k: int) -> bool:
    """Few rows (decode), a dense projection [E, H] in x's dtype whose rows a program holds whole
    (expert_scale None: Qwen's router)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= FUSED_ROWS and x.dtype in SUPPORTED and isinstance(proj, torch.Tensor)
            and proj.dim() == 2 and proj.dtype == x.dtype and proj.shape[1] == x.shape[1] <= FUSED_WIDTH
            and proj.shape[0] <= MAX_EXPERTS and k <= proj.shape[0]
            and (expert_scale is None or expert_scale.shape == proj.shape[:1]))


def router_linear_topk(x: torch.Tensor, proj: torch.Tensor, k: int, renormalize: bool = True):
    """MoeReference.router_linear_topk (Qwen's router_topk of linear(x, proj)) in one launch: x [T, H],
    proj [E, H] -> (weights [T, k] x's dtype, ids [T, k] int64)."""
    return _fused(x, proj, None, k, torch.empty((x.shape[0], k), dtype=x.dtype, device=x.device), renormalize)


def router_scaled_topk(x: torch.Tensor, proj: torch.Tensor, expert_scale: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MoeReference.router_scaled_topk in one launch: x [T, H], proj [E, H] -> (weights [T, k] f32, ids
    [T, k] int64)."""
    return _fused(x, proj, expert_scale, k, torch.empty((x.shape[0], k), dtype=torch.float32, device=x.device))


def _fused(x, proj, expert_scale, k: int, w: torch.Tensor, renormalize: bool = True):
    (t, h), e = x.shape, proj.shape[0]
    x, proj = x.contiguous(), proj.contiguous()
    logits = torch.empty((t, e), dtype=x.dtype, device=x.device)
    idx = torch.empty((t, k), dtype=torch.long, device=x.device)
    # gemm's split-K counters: every kernel touches them only after its PDL wait, so never two at once
    # on one stream (a fork's side stream counts in its own: kiln/ops/fork.py)
    count = arrival_counters(x.device, 1)
    scale = proj if expert_scale is None else expert_scale.contiguous()     # (read only if scaled)
    router_gemv_topk_kernel[(e,)](x, proj, scale, logits, count, w, idx, t, E=e, EP=next_pow2(e), H=h,
                                  HP=next_pow2(h), KTOP=k, KP=next_pow2(k), RNE=rne_flag(x.dtype),
                                  SCALED=expert_scale is not None, RENORM=renormalize, num_warps=4, **pdl(x))
    return w, idx
