"""The attention input path in one launch: per-head RMSNorm of q and k (optional: Llama has none),
rotary embedding of the first R dims of q and k, and the KV-cache write of k and v (optionally
RMS-normed without a weight first: Gemma 4's v_norm).

  q_out = rope(norm(q));  k_buf[positions[t]] = rope(norm(k[t]));  v_buf[positions[t]] = v[t] (or vnorm(v[t]))

(at row positions[t] % ring of a ring buffer: kiln.cache.WindowKVCache; a plain buffer passes NO_RING).

Rounding as the reference composition (ReferenceOps.rmsnorm, then ReferenceOps.apply_rope), where
every step is its own 16-bit torch op: the normed value is rounded as the style says
(rmsnorm.scale_normed), then x*cos, rot*sin and their sum are each rounded to the activation dtype.
rotate_half pairs dim i with i + R/2: rot[i] = -x[i + R/2] for i < R/2, x[i - R/2] for R/2 <= i < R.

The grid is (token blocks, H + KV): program (b, h) takes ROWS tokens of q head h (h < H), or of
k and v head h - H. Positions are read on the device, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from ..attention.kernels import NO_RING
from ..common import COMMON, EXACT_ROUNDING, SUPPORTED, cdiv, pdl, pdl_wait, pow2_dim, rne_flag, round_to
from ..norm.kernels import STYLES, scale_normed, style_scaled
from ..norm.kernels import __file__ as NORM_FILE


@triton.jit
def norm_rope_rows(x_ptr, offs, w_ptr, cs_off, cos_ptr, sin_ptr, ok, eps, D: tl.constexpr, R: tl.constexpr,
                   NORM: tl.constexpr, STYLE: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """ROWS rows of one head: x at offs (element offsets of each row's start), cos/sin at cs_off;
    returns the normed and roped rows [ROWS, D] in dtype. The partner column of each dim is read
    again from memory (L1-resident) and normed with the row's own rstd."""
    cols = tl.arange(0, D)
    half: tl.constexpr = R // 2
    partner = tl.where(cols < half, cols + half, tl.where(cols < R, cols - half, cols))
    inside = ok[:, None] & (cols < D)[None, :]
    xf = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    pf = tl.load(x_ptr + offs[:, None] + partner[None, :], mask=inside, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        wf = tl.load(w_ptr + cols).to(tl.float32)
        wp = tl.load(w_ptr + partner).to(tl.float32)
        xf = scale_normed(xf, rstd, wf, STYLE, dtype, RNE).to(tl.float32)
        pf = scale_normed(pf, rstd, wp, STYLE, dtype, RNE).to(tl.float32)
    rot = tl.where((cols < half)[None, :], -pf, pf)
    rope = (cols < R)[None, :]
    cmask = ok[:, None] & rope
    c = tl.load(cos_ptr + cs_off[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
    a = round_to(xf * c, dtype, RNE).to(tl.float32)
    b = round_to(rot * s, dtype, RNE).to(tl.float32)
    return tl.where(rope, round_to(a + b, dtype, RNE), xf.to(dtype))


@triton.jit(do_not_specialize=["T", "ring"])
def qk_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kb_ptr, vb_ptr, T, eps, ring,
                   sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, scs,
                   H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr,
                   NORM: tl.constexpr, STYLE: tl.constexpr, RNE: tl.constexpr, VNORM: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    hd = tl.program_id(1)
    ok = t < T
    t64 = t.to(tl.int64)
    cols = tl.arange(0, D)
    inside = ok[:, None] & (cols < D)[None, :]
    dtype = qo_ptr.dtype.element_ty
    if hd < H:
        y = norm_rope_rows(q_ptr, t64 * sq_t + hd * sq_h, qw_ptr, t64 * scs, cos_ptr, sin_ptr, ok, eps,
                           D, R, NORM, STYLE, dtype, RNE)
        tl.store(qo_ptr + (t64 * H + hd)[:, None] * D + cols[None, :], y, mask=inside)
    else:
        kh = hd - H
        y = norm_rope_rows(k_ptr, t64 * sk_t + kh * sk_h, kw_ptr, t64 * scs, cos_ptr, sin_ptr, ok, eps,
                           D, R, NORM, STYLE, dtype, RNE)
        slot = tl.load(pos_ptr + t64, mask=ok, other=0).to(tl.int64) % ring
        dst = (slot * KV + kh)[:, None] * D + cols[None, :]
        tl.store(kb_ptr + dst, y, mask=inside)
        vals = tl.load(v_ptr + (t64 * sv_t + kh * sv_h)[:, None] + cols[None, :], mask=inside, other=0.0)
        if VNORM:   # normed in f32, then rounded (ReferenceOps.rmsnorm_noscale)
            vf = vals.to(tl.float32)
            vals = round_to(vf * tl.math.rsqrt(tl.sum(vf * vf, axis=1) / D + eps)[:, None], dtype, RNE)
        tl.store(vb_ptr + dst, vals, mask=inside)


def strides(x: torch.Tensor) -> tuple[int, int]:
    assert x.stride(-1) == 1, "last dim must be contiguous"
    return x.stride(0), x.stride(1)


def qk_rope_into(q, k, v, q_norm_w, k_norm_w, eps, style, cos, sin, k_buf, v_buf, positions, q_out,
                 var: Variant, v_norm: bool = False, ring: int | None = None) -> None:
    t, h, d = q.shape
    kv, r = k.shape[1], cos.shape[-1]
    norm = q_norm_w is not None
    assert (k_norm_w is not None) == norm, "q and k are both normed or neither"
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and q_out.is_contiguous()
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and positions.dtype == torch.int64
    if t == 0:
        return
    p = var.p
    w_q = q_norm_w if norm else q        # any pointer: never read without NORM
    w_k = k_norm_w if norm else q
    qk_rope_kernel[(cdiv(t, p["rows"]), h + kv)](
        q, k, v, w_q, w_k, cos, sin, positions, q_out, k_buf, v_buf, t, eps, NO_RING if ring is None else ring,
        *strides(q), *strides(k), *strides(v),
        cos.stride(0), H=h, KV=kv, D=d, R=r, ROWS=p["rows"], NORM=norm, STYLE=STYLES[style] if norm else 0,
        RNE=rne_flag(q.dtype), VNORM=v_norm, num_warps=p["w"], **pdl(q), **EXACT_ROUNDING)


def qk_rope(q, k, v, q_norm_w, k_norm_w, eps, style, cos, sin, k_buf, v_buf, positions,
            var: Variant | None = None, v_norm: bool = False, ring: int | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D] (strided views allowed, last dim contiguous; v may be k itself);
    q_norm_w/k_norm_w [D] or None (no norm); cos/sin [T, R]; k_buf/v_buf [capacity, KV, D]; positions
    int64 [T] on the device (rows of a ring of `ring` rows: positions % ring); v_norm: v RMS-normed
    without a weight before it is stored. Returns q_out
    [T, H, D] (normed, roped); writes roped k and v into the buffers at positions."""
    shape = shape_of(q, k, cos, style if q_norm_w is not None else None, v_norm)
    var = var or OP.default(shape, device_info(q.device))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qk_rope_into(q, k, v, q_norm_w, k_norm_w, eps, style, cos, sin, k_buf, v_buf, positions, q_out, var, v_norm, ring)
    return q_out


def supports(q, k, v, k_buf, cos) -> bool:
    d, r = q.shape[-1], cos.shape[-1]
    same = all(x.dtype == q.dtype for x in (k, v, k_buf, cos))
    return (q.dtype in SUPPORTED and same and q.dim() == 3 and k.shape == v.shape and k.shape[-1] == d
            and k_buf.shape[1:] == k.shape[1:] and d >= 16 and d & (d - 1) == 0 and r % 2 == 0 and 0 < r <= d
            and q.shape[1] % k.shape[1] == 0 and all(x.stride(-1) == 1 for x in (q, k, v, cos)))


# -- the op: variants, inputs, outputs ----------------------------------------------------------------

@dataclass(frozen=True)
class RopeShape:
    rows: int          # tokens (runtime)
    h: int
    kv: int
    d: int
    r: int             # rotary dims
    style: str | None  # None: no q/k norm
    v_norm: bool = False   # v RMS-normed (no weight) before the append: Gemma 4

    @property
    def key(self) -> tuple:
        return (self.h, self.kv, self.d, self.r, self.style) + (("vnorm",) if self.v_norm else ())


def shape_of(q, k, cos, style, v_norm: bool = False) -> RopeShape:
    return RopeShape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], cos.shape[-1], style, v_norm)


def rope_variant(rows: int, warps: int) -> Variant:
    return variant(f"r{rows}_w{warps}", rows=rows, w=warps)


TRUSTED = rope_variant(1, 4)         # one token of one head per program
CPU_TRUSTED = rope_variant(16, 4)    # under the interpreter, whose cost is per program


def rope_inputs(s: RopeShape, dtype, device, gen) -> dict:
    """q as the first half of a [T, H, 2D] q|gate projection (a strided view, as Qwen3.5's); rows of
    varied scale; cos/sin of scattered positions; buffers with room around the written slots, filled
    with random values (the rows not written must survive)."""
    r = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    t, cap = s.rows, s.rows + 29
    scale = torch.rand(t, 1, 1, generator=gen, device=device) * 4 + 0.25
    q = (r(t, s.h, 2 * s.d) * scale).to(dtype)[..., :s.d]
    positions = torch.randperm(cap, generator=gen, device=device)[:t]
    inv = 1.0 / (10000.0 ** (torch.arange(0, s.r, 2, device=device).float() / s.r))
    freqs = positions[:, None].float() * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    shift = 0.0 if s.style == "offset" else 1.0
    norm = s.style is not None
    return {"q": q, "k": (r(t, s.kv, s.d) * scale).to(dtype), "v": r(t, s.kv, s.d).to(dtype),
            "q_norm_w": (r(s.d) * 0.2 + shift).to(dtype) if norm else None,
            "k_norm_w": (r(s.d) * 0.2 + shift).to(dtype) if norm else None,
            "eps": 1e-6, "style": s.style or "llama", "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype),
            "k_buf": r(cap, s.kv, s.d).to(dtype), "v_buf": r(cap, s.kv, s.d).to(dtype), "positions": positions,
            "v_norm": s.v_norm}


ARGS = ("q", "k", "v", "q_norm_w", "k_norm_w", "eps", "style", "cos", "sin")


class QkRopeOp(Op):
    """Outputs q_out and copies of the cache buffers: launch() copies the input buffers into them and
    writes into the copies, so every variant sees the same inputs and the gate compares the buffers."""
    name = "qk_rope"
    sources = (__file__, COMMON, NORM_FILE)
    shape_type = RopeShape

    def accepts(self, s: RopeShape) -> bool:
        return pow2_dim(s.d) and s.r % 2 == 0 and 0 < s.r <= s.d

    def shape_str(self, s: RopeShape) -> str:
        return f"{s.rows}_h{s.h}-{s.kv}_d{s.d}_r{s.r}_{s.style or 'nonorm'}" + ("_vnorm" if s.v_norm else "")

    def with_rows(self, s: RopeShape, rows: int) -> RopeShape:
        return RopeShape(rows, s.h, s.kv, s.d, s.r, s.style, s.v_norm)

    def catalogue(self, s: RopeShape, dev) -> list[Variant]:
        if dev.capability is None:
            return [CPU_TRUSTED, rope_variant(4, 2), rope_variant(32, 4)]     # few programs: the interpreter
        return [rope_variant(r, w) for r in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]

    def candidates(self, s: RopeShape, dev) -> list[Variant]:
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        per_thread = lambda v: v.p["rows"] * s.d / (32 * v.p["w"])  # noqa: E731
        return [v for v in forms if v == TRUSTED or (1 <= per_thread(v) <= 32 and v.p["rows"] <= max(1, s.rows))]

    def trusted(self, s, dev) -> Variant:
        return CPU_TRUSTED if dev.capability is None else TRUSTED

    def default(self, s: RopeShape, dev) -> Variant:
        if dev.capability is None:
            return CPU_TRUSTED
        return rope_variant(1, max(1, min(4, s.d // 128))) if s.rows <= 64 else rope_variant(4, 4)

    def inputs(self, s: RopeShape, dtype, device, gen) -> dict:
        return rope_inputs(s, dtype, device, gen)

    def outputs(self, s: RopeShape, inputs: dict) -> dict:
        q = inputs["q"]
        return {"q_out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
                "k_buf": torch.empty_like(inputs["k_buf"]), "v_buf": torch.empty_like(inputs["v_buf"])}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        outputs["k_buf"].copy_(inputs["k_buf"])
        outputs["v_buf"].copy_(inputs["v_buf"])
        qk_rope_into(*(inputs[k] for k in ARGS), outputs["k_buf"], outputs["v_buf"], inputs["positions"],
                     outputs["q_out"], v, inputs["v_norm"])

    def compile(self, v: Variant, s: RopeShape, dtype, device) -> list:
        """Runs the variant once on a two-token block (T is not specialised: that compiles it)."""
        if interpreting() or v.run is not None:
            return []
        block = self.with_rows(s, 2)
        inputs = self.inputs(block, dtype, device, torch.Generator(device=device).manual_seed(0))
        self.run(v, inputs, self.outputs(block, inputs))
        return []

    def kernel_sources(self, v: Variant) -> list:
        return [qk_rope_kernel, norm_rope_rows, scale_normed, style_scaled, round_to, pdl_wait]

    def supports(self, q, k, v, k_buf, cos) -> bool:
        return supports(q, k, v, k_buf, cos)


OP = register(QkRopeOp())
