"""Gated DeltaNet: the fused decode step and the chunked prefill, rounding where the reference does
(kiln/ops/gdn/reference.py).

State: conv [K, C] (activation dtype, the last K conv inputs, oldest first) and ssm [Hv, dk, dv] f32,
both updated in place. Model dimensions (Hk, Hv, dk, dv, K) are `tl.constexpr`; the token count T is
a runtime argument that is not specialised.

This file holds the launchers and the tuner's ops; the kernels are in recurrent.py (conv, recurrent,
decode, norm) and chunked.py (prep, solve, wu, scan, state, output):
  conv_kernel       causal depthwise conv over [conv[1:], x] + SiLU; the program of the first token
                    block (the only one reading the state) writes the new last K inputs.
  recurrent_kernel  token by token (no tl.dot), one program per value head, gated norm fused: the
                    trusted prefill, and with conv_kernel the trusted ("unfused") decode step.
  decode_kernel     the whole decode step in one launch: conv + SiLU + l2norm of the q/k head it needs
                    (recomputed by every program that reads it), the delta rule on a [dk, BV] state
                    tile, the gated norm when BV == dv (else a second tiny norm_kernel pass).
  prep_kernel       per (value head, chunk of 64): A = strictly-lower(k_beta k^T * decay), (I + A)^-1
                    on tensor cores, w = (I + A)^-1 (k_beta * exp(cum)), u = (I + A)^-1 (v * beta).
  scan_kernel       per (value head, dv block): the chunks in order with the state tile in registers;
                    gated norm fused when BV == dv.
  state_kernel      the split form (fla's layout): per (value head, dv block) the chunks in order, storing
  output_kernel     the state before each chunk and v_new; then every (chunk, head, dv block) output at
                    once. The serial part is two small dots a chunk instead of five plus the norm.

Dot precision of prep/scan (PREC of a chunk variant): "ieee" / "tf32x3" / "tf32" multiply f32 operands;
"bf16" rounds both operands of every dot to the activation dtype (when it is 16-bit; with f32
activations it is "ieee") and accumulates in f32 on tensor cores, as flash-linear-attention does. The
state S stays f32 in registers and memory; only its copy fed to a dot is rounded. The (I + A)^-1 solve
stays f32 ("ieee"): its products feed every w and u, and it is a small share of the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, try_unmeasured, variant
from ..common import COMMON, SUPPORTED, cdiv, dot_flags, pdl, pdl_wait, pow2_dim, rne_flag
from ..gemm.helpers import __file__ as HELPERS_FILE
from ..gemm.helpers import last_arrival
from . import chunked as chunked_kernels
from . import recurrent as recurrent_kernels
from . import reference as gdn_reference
from .chunked import (
    chunk_decays,
    output_kernel,
    prep_kernel,
    scan_kernel,
    solve_kernel,
    state_kernel,
    unit_lower_inverse,
    unit_lower_inverse_dots,
    wu_kernel,
)
from .recurrent import (
    CHUNK,
    CONV_BT,
    conv,
    conv_kernel,
    conv_prefetch,
    decode_conv,
    decode_kernel,
    gated_norm,
    norm_kernel,
    recurrent_kernel,
    store_state,
)
from .reference import GdnReference

# -- launching -------------------------------------------------------------------------------------------

def round_wn(qkv: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """Whether torch rounds w * normed (both 16-bit: the product stays 16-bit)."""
    return torch.promote_types(norm_w.dtype, qkv.dtype) != torch.float32


def gated_norm_pass(o, z, norm_w, y, eps, dv: int) -> None:
    rows = o.numel() // dv
    norm_kernel[(cdiv(rows, 4),)](o, z, norm_w, y, rows, eps, DV=dv, ROWS=4, ROUND_WN=round_wn(o, norm_w),
                                  RNE=rne_flag(o.dtype), num_warps=4, **pdl(o))


def recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, warps: int = 4) -> None:
    hk, hv, dk, dv, eps = dims
    recurrent_kernel[(hv,)](xc, z, b, a, A_log, dt_bias, norm_w, ssm, y, xc.shape[0], eps, dk ** -0.5, HK=hk, HV=hv,
                            DK=dk, DV=dv, ROUND_WN=round_wn(xc, norm_w), RNE=rne_flag(xc.dtype), num_warps=warps)


def dot_precision(prec: str, dtype: torch.dtype) -> tuple[str, bool, bool]:
    """(PREC for the f32 dots, DOT16, UPCAST) of the kernels. "bf16": 16-bit operands (the activation
    dtype) with f32 accumulation; with f32 activations it is "ieee" (f32 stays exact for the tests)."""
    if prec != "bf16":
        return prec, False, False
    dot16 = dtype != torch.float32
    return "ieee", dot16, dot16 and dot_flags(dtype)["UPCAST"]


def chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p: dict) -> None:
    hk, hv, dk, dv, eps = dims
    t, bv, rne = xc.shape[0], p["bv"], rne_flag(xc.dtype)
    prec, dot16, upcast = dot_precision(p["prec"], xc.dtype)
    w, u, cum = prep(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, None)
    o = y if bv == dv else torch.empty_like(y)
    scan_kernel[(hv, dv // bv)](xc, z, norm_w, w, u, cum, ssm, y, o, t, eps, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv,
                                BV=bv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, ROUND_WN=round_wn(xc, norm_w),
                                RNE=rne, num_warps=p["w"])
    if bv != dv:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def prep(xc, b, a, A_log, dt_bias, dims, warps, prec, dot16, upcast, rne, kd_dtype, inv=None, solve_dots=False):
    """w, u, cum (and kd when kd_dtype is given: w and kd in that dtype) of every chunk: prep_kernel."""
    hk, hv, dk, dv, _ = dims
    npad = cdiv(xc.shape[0], CHUNK) * CHUNK
    wdt = kd_dtype or torch.float32
    w = torch.empty((hv, npad, dk), dtype=wdt, device=xc.device)
    u = torch.empty((hv, npad, dv), dtype=torch.float32, device=xc.device)
    cum = torch.empty((hv, npad), dtype=torch.float32, device=xc.device)
    kd = torch.empty_like(w) if kd_dtype is not None else w
    prep_kernel[(hv, npad // CHUNK)](xc, b, a, A_log, dt_bias, w, u, cum, kd, xc.shape[0], HK=hk, HV=hv, DK=dk, DV=dv,
                                     BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, KD=kd_dtype is not None,
                                     INV=inv or prec, SOLVE_DOTS=solve_dots, num_warps=warps)
    return (w, u, cum, kd) if kd_dtype is not None else (w, u, cum)


def prep_in_two(xc, b, a, A_log, dt_bias, dims, warps, prec, dot16, upcast, rne, buf, inv, solve_dots):
    """prep() as two kernels (solve_kernel, then wu_kernel over two parts): w, u, cum, kd."""
    hk, hv, dk, dv, _ = dims
    t = xc.shape[0]
    npad = cdiv(t, CHUNK) * CHUNK
    flags = dict(HK=hk, HV=hv, DK=dk, DV=dv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, num_warps=warps)
    ainv = torch.empty((hv, npad, CHUNK), dtype=buf, device=xc.device)
    cum = torch.empty((hv, npad), dtype=torch.float32, device=xc.device)
    solve_kernel[(hv, npad // CHUNK)](xc, b, a, A_log, dt_bias, ainv, cum, t, INV=inv or prec, SOLVE_DOTS=solve_dots,
                                      **flags)
    w = torch.empty((hv, npad, dk), dtype=buf, device=xc.device)
    kd = torch.empty_like(w)
    u = torch.empty((hv, npad, dv), dtype=torch.float32, device=xc.device)
    wu_kernel[(hv, npad // CHUNK, 2)](xc, b, ainv, cum, w, u, kd, t, **flags)
    return w, u, cum, kd


def split(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p: dict) -> None:
    """The chunked rule as fla lays it out: prep (parallel), the state before every chunk (serial over
    chunks, parallel over heads and dv blocks), then every chunk's output at once. Same arithmetic as
    chunked(); under DOT16 the buffers that only feed dots (w, kd, h, v_new) are 16-bit."""
    hk, hv, dk, dv, eps = dims
    t, rne = xc.shape[0], rne_flag(xc.dtype)
    nch = cdiv(t, CHUNK)
    prec, dot16, upcast = dot_precision(p["prec"], xc.dtype)
    buf = xc.dtype if dot16 else torch.float32
    inv = p.get("inv") if xc.dtype != torch.float32 else None      # f32 activations stay exact (tests)
    if p.get("prep2"):
        w, u, cum, kd = prep_in_two(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, buf, inv,
                                    p.get("solve") == "dots")
    else:
        w, u, cum, kd = prep(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, buf, inv,
                             p.get("solve") == "dots")
    hs = torch.empty((hv, nch, dk, dv), dtype=buf, device=xc.device)
    vn = torch.empty((hv, nch * CHUNK, dv), dtype=buf, device=xc.device)
    state_kernel[(hv, dv // p["hbv"])](w, u, kd, cum, ssm, hs, vn, t, HV=hv, DK=dk, DV=dv, BV=p["hbv"], BT=CHUNK,
                                       PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, num_warps=p["hw"],
                                       **({"num_stages": p["hs"]} if p.get("hs") else {}))
    bv = p["obv"]
    o = y if bv == dv else torch.empty_like(y)
    output_kernel[(nch, hv, dv // bv)](xc, z, norm_w, cum, hs, vn, y, o, t, eps, dk ** -0.5, HK=hk, HV=hv, DK=dk,
                                       DV=dv, BV=bv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast,
                                       ROUND_WN=round_wn(xc, norm_w), RNE=rne, num_warps=p["ow"])
    if bv != dv:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def torch_chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y) -> None:
    """The reference's chunked WY/UT form in torch ops (cuBLAS batched matmuls, one small step per
    chunk): a measured alternative to the Triton scan, whose f32 dots are slow on Hopper."""
    hk, hv, dk, dv, eps = dims
    t, ref = xc.shape[0], GdnReference()
    q, k, v = xc.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    state = SimpleNamespace(ssm=ssm)
    o = ref.gdn_chunked(q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), g, torch.sigmoid(b), state)
    ssm.copy_(state.ssm)
    y.copy_(ref.gated_rmsnorm(o, z.view(t, hv, dv), norm_w, eps).reshape(t, hv * dv))


def prefill_into(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant, y) -> None:
    mix(conv(qkv, conv_w, conv_state), z, b, a, A_log, dt_bias, norm_w, ssm, dims, v, y)


def mix(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, v: Variant, y) -> None:
    """The delta rule and the gated norm over the conv output xc, in variant v's form."""
    if v.p["form"] == "torch":
        torch_chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y)
    elif v.p["form"] == "recurrent":
        recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p["w"])
    elif v.p["form"] == "split":
        split(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p)
    else:
        chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-key-head arrival counters of the decode kernel, zero between launches (the last arrival
    resets its own). NOTE: allocate (run once) before capturing a CUDA graph that uses them."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def decode_into(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant, y) -> None:
    hk, hv, dk, dv, eps = dims
    p = v.p
    if p["form"] == "unfused":
        xc = conv(qkv, conv_w, conv_state)
        recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p["w"])
        return
    bv, last = p["bv"], p.get("last", False) and p["bv"] != dv
    o = y if bv == dv else torch.empty_like(y)
    counts = arrival_counters(qkv.device, hk + hv)
    decode_kernel[(hv, dv // bv)](qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, y, o, counts, eps,
                                  dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, K=conv_w.shape[-1], BV=bv,
                                  ROUND_WN=round_wn(qkv, norm_w), RNE=rne_flag(qkv.dtype), num_warps=p["w"],
                                  LAST_NORM=last, **pdl(qkv))
    if bv != dv and not last:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def _shape(qkv, conv_w, ssm, dims) -> GdnShape:
    hk, hv, dk, dv, _ = dims
    return GdnShape(qkv.shape[0], hk, hv, dk, dv, conv_w.shape[-1])


def gdn_prefill(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant | None = None):
    """The GDN mixer over T >= 1 tokens (ReferenceOps.gated_deltanet without the length bookkeeping):
    y [T, Hv*dv]; conv_state and ssm updated in place."""
    assert conv_state.is_contiguous() and ssm.is_contiguous() and conv_w.is_contiguous()   # updated in place
    v = v or PREFILL.default(_shape(qkv, conv_w, ssm, dims), device_info(qkv.device))
    y = torch.empty((qkv.shape[0], dims[1] * dims[3]), dtype=qkv.dtype, device=qkv.device)
    prefill_into(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, A_log, dt_bias, norm_w,
                 conv_state, ssm, dims, v, y)
    return y


def gdn_decode(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant | None = None):
    """One token (T == 1): y [1, Hv*dv]; conv_state and ssm updated in place. CUDA-graph capturable."""
    assert conv_state.is_contiguous() and ssm.is_contiguous() and conv_w.is_contiguous()   # updated in place
    v = v or DECODE.default(_shape(qkv, conv_w, ssm, dims), device_info(qkv.device))
    y = torch.empty((1, dims[1] * dims[3]), dtype=qkv.dtype, device=qkv.device)
    decode_into(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, A_log, dt_bias, norm_w,
                conv_state, ssm, dims, v, y)
    return y


def gdn_decode_rows(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_pool, ssm_pool, slots, dims,
                    v: Variant) -> torch.Tensor:
    """One token of each of B requests in one launch: row r's states are slot slots[r] (int [B] on the
    device) of conv_pool [S, K, C] and ssm_pool [S, Hv, dk, dv], updated in place; y [B, Hv*dv], each
    row bit-identical to gdn_decode on that row and slot alone. `v` is a fused ("fused" form) variant."""
    hk, hv, dk, dv, eps = dims
    p, rows = v.p, qkv.shape[0]
    assert p["form"] != "unfused" and conv_pool.is_contiguous() and ssm_pool.is_contiguous()
    qkv, z, b, a = qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous()
    y = torch.empty((rows, hv * dv), dtype=qkv.dtype, device=qkv.device)
    bv, last = p["bv"], p.get("last", False) and p["bv"] != dv
    o = y if bv == dv else torch.empty_like(y)
    counts = arrival_counters(qkv.device, rows * (hk + hv))
    decode_kernel[(hv, dv // bv, rows)](qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_pool, ssm_pool, y, o,
                                        counts, eps, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, K=conv_w.shape[-1],
                                        BV=bv, ROUND_WN=round_wn(qkv, norm_w), RNE=rne_flag(qkv.dtype),
                                        num_warps=p["w"], LAST_NORM=last, slot_ptr=slots, SLOTS=True, **pdl(qkv))
    if bv != dv and not last:
        gated_norm_pass(o, z, norm_w, y, eps, dv)
    return y


# -- the ops: variants, inputs, outputs --------------------------------------------------------------

@dataclass(frozen=True)
class GdnShape:
    rows: int     # tokens (runtime; 1 for decode)
    hk: int
    hv: int
    dk: int
    dv: int
    k: int        # conv kernel

    @property
    def key(self) -> tuple:
        return (self.hk, self.hv, self.dk, self.dv, self.k)

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv


def chunk_variant(bv: int, w: int, prec: str, pw: int | None = None) -> Variant:
    pw = pw or w
    return variant(f"chunk_bv{bv}_w{w}_pw{pw}_{prec}", form="chunk", bv=bv, w=w, pw=pw, prec=prec)


def split_variant(hbv: int, hw: int, obv: int, ow: int, prec: str, pw: int = 4, inv: str | None = None,
                  hs: int | None = None, solve: str | None = None, prep2: bool = False) -> Variant:
    """inv: the (I + A)^-1 solve's f32 dot precision with 16-bit activations (default ieee); hs: the
    state kernel's pipeline stages (default Triton's); solve "dots": unit_lower_inverse_dots; prep2:
    the prep as two kernels (solve_kernel, wu_kernel) with fewer live tiles each."""
    extra = (f"_inv-{inv}" if inv else "") + (f"_s{hs}" if hs else "") + (f"_{solve}" if solve else "")
    extra += "_p2" if prep2 else ""
    return variant(f"split_h{hbv}w{hw}_o{obv}w{ow}_pw{pw}_{prec}{extra}", form="split", hbv=hbv, hw=hw, obv=obv,
                   ow=ow, pw=pw, prec=prec, inv=inv, hs=hs, solve=solve, prep2=prep2)


def fused_variant(bv: int, w: int, last: bool = False) -> Variant:
    """The decode step in one kernel; BV < DV: the gated norm in norm_kernel, or (last) done by the
    head's last-arriving program."""
    return variant(f"fused_bv{bv}_w{w}" + ("_last" if last else ""), form="fused", bv=bv, w=w, last=last)


RECURRENT = variant("recurrent", form="recurrent", w=4)        # trusted prefill: token by token, no tl.dot
TORCH = variant("torch_chunked", form="torch")                  # the reference's chunked form in torch ops
UNFUSED = variant("unfused", form="unfused", w=4)              # trusted decode: conv kernel + recurrent step
GPU_PREC = ("tf32x3", "ieee")      # "tf32" alone (10-bit mantissa) only when pinned: the state is f32 by contract


def bf16_forms(dv: int) -> list[Variant]:
    """The 16-bit-operand chunk forms that fit sm_90's shared memory at dk = dv = 128, at 8 warps (they
    spill least; sizes in docs/compiler.md)."""
    return [chunk_variant(bv, 8, "bf16", 8) for bv in (32, 64, 128) if bv <= dv]


def split_forms(dv: int) -> list[Variant]:
    """The split (fla-layout) forms on 16-bit dot operands, fastest first: the prep in two kernels with
    the (I + A)^-1 solve in tf32, tf32x3 or f32, then the one-kernel prep (docs/compiler.md). tf32
    leaves less error in the inverse (~2^-11) than its bf16 rounding after (2^-9). Last, the tf32 form
    with the solve on 4 warps: at 8 its 155 registers a thread hold an SM to one program (ncu, H200,
    bench/NOTES.md 2026-12-03), and the solve waits on shared memory with nothing to overlap it."""
    hbv = min(16, dv)
    return [split_variant(hbv, 4, dv, 8, "bf16", pw=8, inv=inv, prep2=True) for inv in ("tf32", "tf32x3", None)] + [
        split_variant(hbv, 4, dv, 8, "bf16"), split_variant(hbv, 4, dv, 8, "bf16", pw=4, inv="tf32", prep2=True)]


def split_next_forms(dv: int) -> list[Variant]:
    """Split forms offered only with KILN_TRY_UNMEASURED=1: every dot in tf32x3 (~f32: the reference's
    chunked rule rounds nowhere to 16 bits) and f32 buffers, the numeric contract's form but 3.6x
    slower than the bf16 one. The dots-form solve (unit_lower_inverse_dots) is never offered on a
    GPU: it faults there (docs/compiler.md)."""
    hbv, half = min(16, dv), max(16, dv // 2)
    return [split_variant(hbv, 4, bv, 8, "tf32x3", pw=8, prep2=True) for bv in (half, dv)]


def gdn_inputs(s: GdnShape, dtype, device, gen) -> dict:
    """Random inputs shaped like the model's (never zeros): decays from HF's A_log / dt_bias init ranges,
    a non-zero prior conv window and state."""
    r = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, device=device) * scale  # noqa: E731
    u = lambda n, lo, hi: lo + (hi - lo) * torch.rand(n, generator=gen, device=device)  # noqa: E731
    t, c = s.rows, s.conv_dim
    dt = torch.exp(u(s.hv, -6.9, -2.3))                                   # dt in [1e-3, 0.1]
    return {"qkv": r(t, c).to(dtype), "z": r(t, s.hv * s.dv).to(dtype), "b": r(t, s.hv).to(dtype),
            "a": r(t, s.hv).to(dtype), "conv_w": r(c, 1, s.k, scale=0.5).to(dtype),
            "A_log": torch.log(u(s.hv, 1.0, 16.0)).to(dtype), "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),
            "norm_w": r(s.dv, scale=0.1).add(1.0).to(dtype), "conv_state": r(s.k, c).to(dtype),
            "ssm": r(s.hv, s.dk, s.dv, scale=0.1), "dims": (s.hk, s.hv, s.dk, s.dv, 1e-6)}


ARGS = ("qkv", "z", "b", "a", "conv_w", "A_log", "dt_bias", "norm_w")


class GdnOp(Op):
    """Outputs y and copies of the state: launch() copies the input state into them and updates the
    copies in place, so the gate can run every variant on the same inputs and compare the state too."""
    sources = (__file__, recurrent_kernels.__file__, chunked_kernels.__file__, gdn_reference.__file__, COMMON,
               HELPERS_FILE)   # last_arrival comes from gemm/helpers.py; torch_chunked runs the reference
    shape_type = GdnShape

    def accepts(self, s: GdnShape) -> bool:
        return pow2_dim(s.dk) and pow2_dim(s.dv)
    into = None

    def shape_str(self, s: GdnShape) -> str:
        return f"{s.rows}_h{s.hk}-{s.hv}_d{s.dk}-{s.dv}_k{s.k}"

    def with_rows(self, s: GdnShape, rows: int) -> GdnShape:
        return GdnShape(rows, s.hk, s.hv, s.dk, s.dv, s.k)

    def inputs(self, s: GdnShape, dtype, device, gen) -> dict:
        return gdn_inputs(s, dtype, device, gen)

    def outputs(self, s: GdnShape, inputs: dict) -> dict:
        q = inputs["qkv"]
        return {"y": torch.empty((q.shape[0], s.hv * s.dv), dtype=q.dtype, device=q.device),
                "conv": torch.empty_like(inputs["conv_state"]), "ssm": torch.empty_like(inputs["ssm"])}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        outputs["conv"].copy_(inputs["conv_state"])
        outputs["ssm"].copy_(inputs["ssm"])
        type(self).into(*(inputs[k] for k in ARGS), outputs["conv"], outputs["ssm"], inputs["dims"], v, outputs["y"])

    def compile(self, v: Variant, s: GdnShape, dtype, device) -> list:
        """Runs the variant once on a small block (a full and a ragged chunk): T is not specialised, so
        that compiles every kernel it launches for this shape."""
        if interpreting() or v.run is not None:
            return []
        block = self.with_rows(s, 1 if self.name == "gdn_decode" else CHUNK + 1)
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = self.inputs(block, dtype, device, gen)
        self.run(v, inputs, self.outputs(block, inputs))
        return []

    def supports(self, qkv, conv_w, ssm, dims) -> bool:
        hk, hv, dk, dv, _ = dims
        pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
        return (qkv.dtype in SUPPORTED and conv_w.dtype == qkv.dtype and ssm.dtype == torch.float32
                and pow2(dk) and pow2(dv) and hv % hk == 0 and conv_w.shape[-1] - 1 <= CONV_BT)


class GdnPrefillOp(GdnOp):
    name = "gdn_prefill"
    into = staticmethod(prefill_into)

    def catalogue(self, s: GdnShape, dev) -> list[Variant]:
        bvs = [bv for bv in (16, 32, 64, 128) if bv <= s.dv]
        if dev.capability is None:
            small = [chunk_variant(16, 4, "ieee"), split_variant(16, 4, 16, 4, "ieee")] if s.dv > 16 else []
            return [RECURRENT, TORCH, chunk_variant(s.dv, 4, "ieee"), split_variant(s.dv, 4, s.dv, 4, "ieee")] + small
        forms = [RECURRENT, TORCH] + [chunk_variant(bv, w, prec) for prec in GPU_PREC + ("tf32",) for bv in bvs[1:]
                               for w in (4, 8)]
        forms += [chunk_variant(bv, w, "bf16", 8) for bv in bvs[1:] for w in (4, 8)]
        forms += [chunk_variant(bv, 4, prec, 8) for prec in GPU_PREC for bv in bvs[1:]]
        return forms + split_forms(s.dv) + split_next_forms(s.dv)

    def candidates(self, s: GdnShape, dev) -> list[Variant]:
        """A few forms only: every form compiles for seconds, and a cold load compiles them all."""
        forms = [v for v in self.catalogue(s, dev) if v.p.get("prec") != "tf32"]
        if dev.capability is None:
            return forms
        # Of the scans only the ieee one at bv 32, 8 warps, fits sm_90's shared memory and runs well; the
        # 16-bit-operand scans (bf16_forms) fault there, so they are never run (docs/compiler.md).
        keep = [RECURRENT, TORCH, chunk_variant(32, 8, "ieee", 8)] + split_forms(s.dv)
        if try_unmeasured():
            keep += split_next_forms(s.dv)
        return [v for v in forms if v in keep]

    def trusted(self, s, dev) -> Variant:
        return RECURRENT

    def default(self, s: GdnShape, dev) -> Variant:
        if dev.capability is None:
            return chunk_variant(s.dv, 4, "ieee")
        return split_forms(s.dv)[0]   # the fastest split form

    def kernel_sources(self, v: Variant) -> list:
        if v.p["form"] == "recurrent":
            return [conv_kernel, recurrent_kernel]
        if v.p["form"] == "torch":
            return [conv_kernel]
        if v.p["form"] == "split":
            return [conv_kernel, prep_kernel, chunk_decays, solve_kernel, wu_kernel, unit_lower_inverse,
                    unit_lower_inverse_dots, state_kernel, output_kernel, norm_kernel]
        return [conv_kernel, prep_kernel, chunk_decays, unit_lower_inverse, scan_kernel] + [norm_kernel]


class GdnDecodeOp(GdnOp):
    name = "gdn_decode"
    into = staticmethod(decode_into)

    def blocks(self, s) -> tuple[int, int]:
        return 1, 1

    def catalogue(self, s: GdnShape, dev) -> list[Variant]:
        bvs = [bv for bv in (16, 32, 64, 128) if bv <= s.dv]
        if s.k != 4:                # the fused kernel holds the conv state as 3 rows (Qwen3.5's kernel of 4)
            return [UNFUSED]
        if dev.capability is None:
            small = [fused_variant(16, 4), fused_variant(16, 4, last=True)] if s.dv > 16 else []
            return [UNFUSED, fused_variant(s.dv, 4)] + small
        # at most 128 state floats a thread: more only spills
        forms = [fused_variant(bv, w) for bv in bvs for w in (1, 2, 4, 8) if bv * s.dk <= 128 * 32 * w]
        # the gated norm by the head's last arrival instead of norm_kernel: one launch fewer a layer
        # where BV < dv wins (the 9B and larger)
        forms += [fused_variant(bv, w, last=True) for bv in bvs[:-1] for w in (1, 2, 4) if bv * s.dk <= 128 * 32 * w]
        return [UNFUSED] + forms

    def trusted(self, s, dev) -> Variant:
        return UNFUSED

    def default(self, s: GdnShape, dev) -> Variant:
        if s.k != 4:
            return UNFUSED
        return fused_variant(s.dv, 4 if dev.capability is None else 8)

    def kernel_sources(self, v: Variant) -> list:
        if v.p["form"] == "unfused":
            return [conv_kernel, recurrent_kernel]
        return [decode_kernel, conv_prefetch, decode_conv, store_state, pdl_wait, last_arrival, gated_norm] + (
            [] if v.p.get("last") else [norm_kernel])


PREFILL = register(GdnPrefillOp())
DECODE = register(GdnDecodeOp())
