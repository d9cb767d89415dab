"""An MLP's gate|up projection with its activation in the epilogue: y[M, I] = act(x @ Wg^T) * (x @ Wu^T),
W = [Wg; Wu] the packed [2I, K] weight (the model's gate_up_proj, merged at load).

Each program accumulates the gate and the up tile of the same columns (two f32 accumulators over
one pass of x), then rounds as the unfused ops do: gate and up to the activation dtype (the GEMM's
output), act(gate) rounded, the product rounded (ReferenceOps.act_mul). For few rows, split-K: each
split writes f32 partials and the last to arrive adds them in split order and applies the epilogue.
The unfused form (the plan's GEMM on W, then the act_mul kernel) is a variant too: the tuner keeps
whichever measures faster. SiLU and sigmoid only (torch's tanh GELU has no bit-exact Triton twin).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from ..common import SUPPORTED, dot_flags, pdl, pdl_wait, rne_flag, round_to
from . import activation, gemm, hgemv


@triton.jit
def act_mul_epilogue(acc_g, acc_u, dtype: tl.constexpr, ACT: tl.constexpr, RNE: tl.constexpr):
    g = round_to(acc_g, dtype, RNE).to(tl.float32)
    u = round_to(acc_u, dtype, RNE).to(tl.float32)
    a = round_to(activation.act_f32(g, ACT), dtype, RNE).to(tl.float32)
    return round_to(a * u, dtype, RNE)


@triton.jit(do_not_specialize=["M"])
def gemm_act_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                    ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Program (tile, split): the BM x BN tile of y at columns rn reads w rows rn (gate) and N + rn (up).
    With SPLIT_K > 1: partials to ws [SPLIT_K, 2, M, N]; the last arrival (per-tile counter) sums them.
    The first K step's weights load before pdl_wait (weights are never written)."""
    pid_m, pid_n = gemm.tile_of(tl.program_id(0), M, BM, N, BN, GROUP_M)
    split = tl.program_id(1)
    SPAN: tl.constexpr = (K + SPLIT_K * BK - 1) // (SPLIT_K * BK) * BK
    EVEN: tl.constexpr = SPAN * SPLIT_K == K
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = split * SPAN + tl.arange(0, BK)
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * K + rk[None, :]
    wg = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[None, :] * K + rk[:, None]
    wu = wg + N * K
    # Row tiles of 64 and up run on wgmma only when every dot sits in the loop: a first K step peeled
    # off before pdl_wait (its weight loads overlapping the kernel before) makes Triton fall back to
    # mma.sync for the whole kernel. Narrow tiles (decode rows) are mma.sync anyway: they peel.
    PEEL: tl.constexpr = BM < 64
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    start = 0
    if PEEL:
        if EVEN:
            bg0 = tl.load(wg)
            bu0 = tl.load(wu)
        else:
            bg0 = tl.load(wg, mask=(rk < K)[:, None], other=0.0)
            bu0 = tl.load(wu, mask=(rk < K)[:, None], other=0.0)
        pdl_wait(PDL)
        a = gemm.masked_k(xs, rk, K, EVEN, True)
        acc_g = gemm.mma(acc_g, a, bg0, UPCAST, IEEE)
        acc_u = gemm.mma(acc_u, a, bu0, UPCAST, IEEE)
        xs += BK
        wg += BK
        wu += BK
        start = BK
    else:
        pdl_wait(PDL)
    for k in range(start, SPAN, BK):
        if EVEN:
            a = tl.load(xs)
            bg = tl.load(wg)
            bu = tl.load(wu)
        else:
            inside = rk + k < K
            a = tl.load(xs, mask=inside[None, :], other=0.0)
            bg = tl.load(wg, mask=inside[:, None], other=0.0)
            bu = tl.load(wu, mask=inside[:, None], other=0.0)
        acc_g = gemm.mma(acc_g, a, bg, UPCAST, IEEE)
        acc_u = gemm.mma(acc_u, a, bu, UPCAST, IEEE)
        xs += BK
        wg += BK
        wu += BK
    keep = (rm < M)[:, None] & (rn < N)[None, :]
    dtype = y_ptr.dtype.element_ty
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, act_mul_epilogue(acc_g, acc_u, dtype, ACT, RNE), mask=keep)
    else:
        part = (rm.to(tl.int64)[:, None] * N + rn[None, :])
        tl.store(ws_ptr + (2 * split) * M * N + part, acc_g, mask=keep)
        tl.store(ws_ptr + (2 * split + 1) * M * N + part, acc_u, mask=keep)
        if gemm.last_arrival(count_ptr, tl.program_id(0), SPLIT_K):
            tg = tl.zeros((BM, BN), dtype=tl.float32)
            tu = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):          # split order: the same sum whoever is last
                tg += tl.load(ws_ptr + (2 * s) * M * N + part, mask=keep, other=0.0, cache_modifier=".cg")
                tu += tl.load(ws_ptr + (2 * s + 1) * M * N + part, mask=keep, other=0.0, cache_modifier=".cg")
            tl.store(out, act_mul_epilogue(tg, tu, dtype, ACT, RNE), mask=keep)
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0)


def gemm_act(x: torch.Tensor, w: torch.Tensor, act: str, v: Variant, y: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel; x [M, K] contiguous, w [2I, K] contiguous (gate rows first)."""
    (m, k), n = x.shape, w.shape[0] // 2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if y is None else y
    if m == 0:
        return y
    p = v.p
    sk = p.get("sk", 1)
    ws = y if sk == 1 else torch.empty((sk, 2, m, n), dtype=torch.float32, device=x.device)
    counts = gemm.arrival_counters(x.device, gemm.tiles(m, n, p)) if sk > 1 else y
    gemm_act_kernel[(gemm.tiles(m, n, p), sk)](x, w, y, ws, counts, m, N=n, K=k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                               GROUP_M=gemm.GROUP_M, SPLIT_K=sk, ACT=activation.ACTS[act],
                                               RNE=rne_flag(x.dtype), **dot_flags(x.dtype), num_warps=p["w"],
                                               num_stages=p["s"], **pdl(x))
    return y


@dataclass(frozen=True)
class GemmActShape:
    rows: int     # M, tokens (runtime)
    n: int        # I: output features (the weight has 2I rows)
    k: int
    act: str

    @property
    def key(self) -> tuple:
        return (self.n, self.k, self.act)

    def gemm(self) -> gemm.GemmShape:
        return gemm.GemmShape(self.rows, 2 * self.n, self.k)


def fused_variant(bm, bn, bk, w, s, sk=1) -> Variant:
    return variant(f"fused_bm{bm}_bn{bn}_bk{bk}_w{w}_s{s}" + (f"_sk{sk}" if sk > 1 else ""),
                   bm=bm, bn=bn, bk=bk, w=w, s=s, sk=sk)


def unfused(inputs: dict, outputs: dict, plan, trusted: bool = False) -> None:
    """The GEMM on the concatenated weight (the plan's choice, or the trusted one), then act_mul."""
    x, w, act = inputs["x"], inputs["w"], inputs["act"]
    shape = GemmActShape(x.shape[0], w.shape[0] // 2, x.shape[1], act).gemm()
    dev = plan.dev if plan is not None else device_info(x.device)
    gv = gemm.OP.trusted(shape, dev) if trusted else (plan.choose(gemm.OP, shape) if plan is not None else
                                                    gemm.OP.default(shape, dev))
    h = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if gv.p.get("tma") and not gemm.tma_ok(x, w, h):
        gv = gemm.OP.default(shape, dev)
    gemm.OP.run(gv, {"x": x, "w": w}, {"y": h}, plan)
    g, u = h.split(w.shape[0] // 2, dim=-1)
    activation.act_mul(g, u, act, outputs["y"])


UNFUSED = variant("unfused", run=unfused)
UNFUSED_TRUSTED = variant("unfused_trusted", run=lambda i, o, plan: unfused(i, o, plan, trusted=True))
GPU_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3)]
GPU_SPLITS = [((16, 64, 128, 4, 4), sk) for sk in (2, 4, 8)] + [((16, 32, 256, 4, 3), sk) for sk in (4, 8)]
CPU_TILES = [(128, 128, 32, 4, 1), (16, 64, 64, 4, 1), (32, 16, 64, 4, 1)]
CPU_SPLITS = [((16, 64, 32, 4, 1), 3)]


class ActShapes:
    """Names, row changes and kernel support of the (rows, n, k, act) shapes of gemm_act and act_gemm."""

    def accepts(self, s) -> bool:
        # the interpreter: these kernels are tested on their own, not tuned for whole models
        return s.act in activation.ACTS and not interpreting()

    def shape_str(self, s) -> str:
        return f"{s.rows}x{s.n}x{s.k}_{s.act}"

    def with_rows(self, s, rows: int):
        return replace(s, rows=rows)


class GemmActOp(ActShapes, Op):
    """The gate|up GEMM with act(g) * u in its epilogue, or the GEMM then act_mul (at one row the
    unfused pair can win: the tuner measures both)."""
    name = "gemm_act"
    sources = (__file__, *gemm.GemmOp.sources)   # gemm.py's own sources included
    shape_type = GemmActShape

    def catalogue(self, s, dev) -> list[Variant]:
        tiles, splits = (CPU_TILES, CPU_SPLITS) if dev.capability is None else (GPU_TILES, GPU_SPLITS)
        return ([UNFUSED_TRUSTED, UNFUSED] + [fused_variant(*t) for t in tiles]
                + [fused_variant(*t, sk=k) for t, k in splits])

    def candidates(self, s, dev) -> list[Variant]:
        forms = [v for v in self.catalogue(s, dev) if v.run is not None or gemm.fits(s, v.p)]
        if dev.capability is None:
            return forms
        # split-K only where the tiles alone leave SMs idle (worth_measuring): it also keeps the shared
        # arrival counters from growing after a CUDA graph captured their address
        return [v for v in forms if v.run is not None or gemm.worth_measuring(s, v.p, dev.sms)]

    def trusted(self, s, dev) -> Variant:
        return UNFUSED_TRUSTED

    def default(self, s, dev) -> Variant:
        return UNFUSED

    def inputs(self, s: GemmActShape, dtype, device, gen) -> dict:
        x = torch.randn(s.rows, s.k, generator=gen, device=device)
        w = torch.randn(2 * s.n, s.k, generator=gen, device=device) * s.k ** -0.5 * 2.0   # gates across act's bend
        return {"x": x.to(dtype), "w": w.to(dtype), "act": s.act}

    def outputs(self, s, inputs: dict) -> dict:
        x = inputs["x"]
        return {"y": torch.empty((x.shape[0], inputs["w"].shape[0] // 2), dtype=x.dtype, device=x.device)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        gemm_act(inputs["x"], inputs["w"], inputs["act"], v, outputs["y"])

    def compile(self, v: Variant, s: GemmActShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        x = torch.empty((1, s.k), dtype=dtype, device=device)
        w = torch.empty((2 * s.n, s.k), dtype=dtype, device=device)
        y = torch.empty((1, s.n), dtype=dtype, device=device)
        p, sk = v.p, v.p["sk"]
        ws = y if sk == 1 else torch.empty((sk, 2, 1, s.n), dtype=torch.float32, device=device)
        counts = torch.zeros(1, dtype=torch.int32, device=device) if sk > 1 else y
        return [gemm_act_kernel.warmup(x, w, y, ws, counts, 1, N=s.n, K=s.k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                       GROUP_M=gemm.GROUP_M, SPLIT_K=sk, ACT=activation.ACTS[s.act], RNE=False,
                                       **dot_flags(dtype), num_warps=p["w"], num_stages=p["s"], grid=(1,),
                                       **pdl(x))]

    def kernel_sources(self, v: Variant) -> list:
        if v.run is not None:
            return []
        return [gemm_act_kernel, act_mul_epilogue, activation.act_f32, gemm.tile_of, gemm.mma, gemm.masked_k,
                gemm.last_arrival, round_to, pdl_wait]

    def supports(self, x, w, act) -> bool:
        return x.dtype in SUPPORTED and w.dtype == x.dtype and act in activation.ACTS and w.shape[0] % 2 == 0


OP = register(GemmActOp())


# -- the down projection with act(g) * u as its input: decode's MLP in two launches ------------------

@dataclass(frozen=True)
class ActGemmShape:
    rows: int     # M (runtime): one at decode
    n: int        # output features (the hidden size)
    k: int        # I: the down projection's input width; its input rows are [g | u], 2I wide
    act: str

    @property
    def key(self) -> tuple:
        return (self.n, self.k, self.act)

    def gemm(self) -> gemm.GemmShape:
        return gemm.GemmShape(self.rows, self.n, self.k)


def act_then_gemm(inputs: dict, outputs: dict, plan, trusted: bool = False) -> None:
    """act_mul, then the GEMM (the plan's choice, or the trusted one)."""
    gu, w, act = inputs["gu"], inputs["w"], inputs["act"]
    g, u = gu.split(w.shape[1], dim=-1)
    h = activation.act_mul(g, u, act)
    shape = gemm.GemmShape(gu.shape[0], w.shape[0], w.shape[1])
    dev = plan.dev if plan is not None else device_info(gu.device)
    gv = gemm.OP.trusted(shape, dev) if trusted else (plan.choose(gemm.OP, shape) if plan is not None else
                                                    gemm.OP.default(shape, dev))
    if gv.p.get("tma") and not gemm.tma_ok(h, w, outputs["y"]):
        gv = gemm.OP.default(shape, dev)
    gemm.OP.run(gv, {"x": h, "w": w}, {"y": outputs["y"]}, plan)


ACT_UNFUSED = variant("unfused", run=act_then_gemm)
ACT_UNFUSED_TRUSTED = variant("unfused_trusted", run=lambda i, o, plan: act_then_gemm(i, o, plan, trusted=True))


class ActGemmOp(ActShapes, Op):
    """y = (act(g) * u) @ w^T from the gate|up GEMM's output [M, 2I]: act_mul and the GEMM (two
    launches), or one GEMV (gemm.py's gemv_kernel) that computes act(g) * u as it loads x."""
    name = "act_gemm"
    sources = (__file__, *gemm.GemmOp.sources)   # gemm.py's own sources included
    shape_type = ActGemmShape

    def catalogue(self, s, dev) -> list[Variant]:
        if dev.capability is None:
            gemv = [gemm.gemv_variant(*g) for g in gemm.CPU_GEMV]
        else:
            gemv = [gemm.gemv_variant(*g, whole=whole) for g in gemm.GEMV_FORMS for whole in (False, True)]
            gemv += gemm.hgemv_forms(s, dev)      # the CUDA C form computing act(g) * u as it loads x
        return [ACT_UNFUSED_TRUSTED, ACT_UNFUSED] + (gemv if s.rows == 1 else [])

    def candidates(self, s, dev) -> list[Variant]:
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        return [v for v in forms if v.run is not None or v.p.get("hgemv") or (gemm.gemv_worth(s, v.p, dev.sms) and
                                                           (not v.p["whole"] or gemm.whole_fits(s, v.p)))]

    def trusted(self, s, dev) -> Variant:
        return ACT_UNFUSED_TRUSTED

    def default(self, s, dev) -> Variant:
        return ACT_UNFUSED

    def inputs(self, s: ActGemmShape, dtype, device, gen) -> dict:
        gu = torch.randn(s.rows, 2 * s.k, generator=gen, device=device) * 2.0     # gates across act's bend
        w = torch.randn(s.n, s.k, generator=gen, device=device) * s.k ** -0.5
        return {"gu": gu.to(dtype), "w": w.to(dtype), "act": s.act}

    def outputs(self, s, inputs: dict) -> dict:
        gu = inputs["gu"]
        return {"y": torch.empty((gu.shape[0], inputs["w"].shape[0]), dtype=gu.dtype, device=gu.device)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        gemm.gemm(inputs["gu"], inputs["w"], v, outputs["y"], act=inputs["act"])

    def compile(self, v: Variant, s: ActGemmShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        gu = torch.empty((1, 2 * s.k), dtype=dtype, device=device)
        w = torch.empty((s.n, s.k), dtype=dtype, device=device)
        y = torch.empty((1, s.n), dtype=dtype, device=device)
        p = v.p
        if p.get("hgemv"):        # a CUDA C kernel: compiled and loaded, no Triton launcher
            hgemv.run(gu, w, y, p["bn"], p["w"], p["r"], p["sk"], warm=True, act=activation.ACTS[s.act])
            return []
        ws = y if p["sk"] == 1 else torch.empty((p["sk"], 1, s.n), dtype=torch.float32, device=device)
        counts = torch.zeros(1, dtype=torch.int32, device=device) if p["sk"] > 1 else y
        return [gemm.gemv_kernel.warmup(gu, w, y, ws, counts, 1, N=s.n, K=s.k, BN=p["bn"], BK=p["bk"], SPLIT_K=p["sk"],
                                     RNE=False, WHOLE=p["whole"], ACT=activation.ACTS[s.act], num_warps=p["w"],
                                     num_stages=p["s"], grid=(1,), **pdl(gu))]

    def kernel_sources(self, v: Variant) -> list | str:
        if v.run is not None:
            return []
        if v.p.get("hgemv"):
            return hgemv.SOURCE
        return [gemm.gemv_kernel, gemm.masked_k, gemm.x_slice, activation.act_f32, pdl_wait, round_to,
                gemm.last_arrival]

    def supports(self, gu, w, act) -> bool:
        return (gu.dtype in SUPPORTED and w.dtype == gu.dtype and act in activation.ACTS
                and gu.shape[-1] == 2 * w.shape[1] and gu.is_contiguous())


ACT_OP = register(ActGemmOp())
