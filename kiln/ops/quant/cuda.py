"""The quant family's dispatch, called by the gemm and MoE families' methods (the mixins own disjoint
names: `linear` is gemm's). A few rows (decode) run the tuned quantised GEMV (kernels.py), which reads
the packed words, with decode's norm or activation in its prologue where the tuner keeps that; more
rows dequantise the weight in one kernel pass (embed.py) and run the gemm family's tuned 16-bit
kernel. Embedding lookups and a few tokens' routed experts run on the packed words too."""

from __future__ import annotations

import math
import os

import torch

from ...weights.quantized import QuantizedWeight
from ..fork import join, peek
from ..gemm.activation import ACTS as DP4A_ACTS
from ..moe import kernels as moe_kernels
from . import dp4a, embed, kernels
from .reference import dequantize

GEMV_ROWS = 4     # up to this many rows the GEMV re-reads its slab from L2 for each row; beyond, one GEMM


def quant_linear(ops, x, w: QuantizedWeight):
    """x @ dequantize(w)^T on `ops` (a TunedOps with `linear`), or None where the family is off or
    cannot run here (the caller's reference then dequantises)."""
    if not ops.on("quant", x):
        return None
    k = w.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > GEMV_ROWS or not kernels.OP.supports(x2, w):    # a dense weight: the gemm family's kernels
        return ops.linear(x, embed.qembed(None, w) if embed.supports(None, w) else dequantize(w))
    shape = kernels.QGemvShape(x2.shape[0], w.shape[0], k, w.bits, w.group_size)
    y = kernels.qgemv(x2.contiguous(), w, ops.choose(kernels.OP, shape))
    return y.view(*x.shape[:-1], w.shape[0])


def quant_embed(ops, ids, table: QuantizedWeight):
    """The rows of a quantised table at ids, dequantised in one launch; None where the family is off or
    the lookup does not fit (the caller's reference then gathers and dequantises)."""
    if not ops.on("quant", table.packed) or not embed.supports(ids, table):
        return None
    return embed.qembed(ids, table)


def quant_moe(ops, x, idx, weights, gate_up: QuantizedWeight, down: QuantizedWeight, act: str, gate=None,
              rows: torch.Tensor | None = None, host: tuple | None = None):
    """The routed experts on quantised [E, rows, cols] stacks in three launches: every (token, slot)
    pair's gate|up GEMV, the down GEMV computing act(g) * u as it loads and weighting its output, then
    the MoE family's combine (with Qwen's gated shared expert: gate = (gate_w, shared)). The same
    roundings as MoeReference. None where the family is off or the stacks do not fit (an activation
    the prologue lacks, bits that cross words): the caller's reference then runs. `rows` (idx's shape):
    the stack row holding each pair's expert where it is not the expert's id (streamed experts' slots);
    the combine still adds in expert id order. `host` (gate_up, down stacks in mapped host memory): a
    negative row names expert -1 - row there, read in place (streamed experts' misses)."""
    if not (ops.on("quant", x) and isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
            and gate_up.packed.dim() == down.packed.dim() == 3 and x.dim() == 2 and act in kernels.PAIR_ACTS
            and x.shape[0] <= GEMV_ROWS     # more tokens: the reference's per-expert GEMMs re-read less
            and (gate is None or gate[0].dtype == peek(gate[1]).dtype == x.dtype)
            and all(32 % w.bits == 0 and w.dtype == x.dtype for w in (gate_up, down))
            and (host is None or all(h.packed.shape[1:] == w.packed.shape[1:] for h, w in zip(host, (gate_up, down))))):
        return None
    e, i2, h = gate_up.shape
    up_shape = kernels.QGemvShape(1, i2, h, gate_up.bits, gate_up.group_size)
    down_shape = kernels.QGemvShape(1, h, i2 // 2, down.bits, down.group_size)
    t, k = idx.shape
    pairs, flat = t * k, (idx if rows is None else rows).reshape(-1).contiguous()
    x, rw = x.contiguous(), weights.reshape(-1).contiguous()
    gu = x.new_empty((pairs, i2))
    host_up, host_down = host if host is not None else (None, None)
    # the dp4a pair mode where both GEMVs take it: the down's act(g) * u only as act_mul computes it (not
    # tanh GELU), and Gemma 4's gate|up alone in dp4a measured 3% slower than both in fma (H100, 2026-12-06)
    dp = act in DP4A_ACTS
    v_up = pair_form(ops, up_shape, dp and dp4a.pairs_take(x, gate_up, flat, None, host_up))
    v_down = pair_form(ops, down_shape, dp and dp4a.pairs_take(gu, down, flat, rw, host_down))
    if v_up is None or v_down is None:
        return None
    kernels.qgemv_pairs(x, gate_up, flat, v_up, gu, xdiv=k, host=host_up)
    y = x.new_empty((pairs, h))
    kernels.qgemv_pairs(gu, down, flat, v_down, y, xdiv=1, act=act, rw=rw, host=host_down)
    out = torch.empty_like(x)
    gate = None if gate is None else (gate[0], join(gate[1]))     # a forked shared expert: joined here
    moe_kernels.combine(y, idx.contiguous(), out, x, gate)
    return out


def dequantised_stacks(ops, x, *stacks: QuantizedWeight, first: int = 0, last: int | None = None) -> list | None:
    """A prefill chunk's routed experts: each [E, N, K] stack (or its experts first..last-1) dequantised
    in one launch (bit-exact to dequantize), for the MoE family's grouped GEMM to read once. None where
    the family is off, a stack does not fit the kernel, or the copies would take more than
    stack_room (the caller then takes the experts in batches that fit: MoeCuda._in_batches)."""
    if not stackable(ops, x, *stacks):
        return None
    last = stacks[0].shape[0] if last is None else last
    room = stack_room(x)
    if room is not None and (last - first) * expert_bytes(*stacks) > room:
        return None
    cut = lambda t: t[first:last].reshape(-1, t.shape[-1])      # noqa: E731
    flat = [w._with(cut(w.packed), cut(w.scales), cut(w.biases)) for w in stacks]
    return [embed.qembed(None, f).view(last - first, *w.shape[1:]) for f, w in zip(flat, stacks)]


def gathered_stacks(stacks, slots: torch.Tensor) -> list:
    """The experts at `slots` of each [S, N, K] stack, dequantised (quantised ones: their rows gathered
    and dequantised in one launch, bit-exact to dequantize) into [len(slots), N, K]."""
    out = []
    for w in stacks:
        if isinstance(w, torch.Tensor):
            out.append(w.index_select(0, slots))
            continue
        n = w.packed.shape[1]
        rows = (slots[:, None] * n + torch.arange(n, device=slots.device)).reshape(-1)
        table = w._with(*(t.reshape(-1, t.shape[-1]) for t in (w.packed, w.scales, w.biases)))
        out.append(embed.qembed(rows, table).view(slots.numel(), n, w.shape[2]))
    return out


def stackable(ops, x, *stacks) -> bool:
    """Quantised [E, N, K] stacks the whole-stack dequantiser takes, at more rows than the GEMVs'."""
    return (ops.on("quant", x) and x.shape[0] > GEMV_ROWS          # a few tokens read a few experts
            and all(isinstance(w, QuantizedWeight) and w.packed.dim() == 3 for w in stacks)
            and all(embed.supports(None, w._with(w.packed[0], w.scales[0], w.biases[0])) for w in stacks))


def expert_bytes(*stacks: QuantizedWeight) -> int:
    """One expert's dequantised copies, every stack."""
    return sum(math.prod(w.shape[1:]) * w.dtype.itemsize for w in stacks)


def stack_room(x) -> int | None:
    """Bytes a chunk's dequantised expert copies may take: half the free GPU memory, torch's cached
    blocks counted as free (None off the GPU: no limit), at most KILN_STACK_ROOM_GB where set
    (benchmarks: the batched path on a small model). Without the cached blocks, the room shrank once
    the first batch's copies sat in torch's cache, so the next batch asked for other sizes and the
    allocator went back to the driver (a cudaFree syncs) every batch."""
    rooms = [int(float(cap) * 1e9)] if (cap := os.environ.get("KILN_STACK_ROOM_GB")) else []
    if x.is_cuda:
        cached = torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device)
        rooms.append((torch.cuda.mem_get_info(x.device)[0] + cached) // 2)
    return min(rooms, default=None)


def experts_in(room: int, *stacks: QuantizedWeight) -> int:
    """How many experts' dequantised copies a batch takes in `room` bytes: a power of two (at least
    one), since the grouped kernels take the expert count as a constant (batch sizes that followed
    the free memory would compile anew) and 2^n splits 256 or 512 experts evenly."""
    return 1 << (max(1, room // expert_bytes(*stacks)).bit_length() - 1)


def norm_epilogue_on() -> bool:
    """The add + norm in the projection's last block (KILN_NORM_EPILOGUE=1; off by default): its GPU test
    passes, but on an H100 the tuner kept the GEMV then the norm kernel at every 9B and 27B shape, the tail
    ~0.2-1 us slower than the norm's own launch in a graph (bench/NOTES.md, 2026-12-06; docs/quant.md)."""
    return os.environ.get("KILN_NORM_EPILOGUE", "0") == "1"


def dp4a_pairs_on() -> bool:
    """The routed experts' dp4a pair mode is on (the default; KILN_DP4A_PAIRS=0 takes the fma pairs)."""
    return os.environ.get("KILN_DP4A_PAIRS", "1") != "0"


def pair_form(ops, shape, dp4a_ok: bool):
    """The routed experts' pair GEMV form for one expert's one-row `shape`: with dp4a_ok, the tune's
    choice for that plain shape where it is a dp4a form, unsplit (a load tunes one expert's shapes:
    quant_workloads); else the fma default, unsplit (unsplit). On an H100 the dp4a pairs took the
    35B-A3B's 4-bit decode from 489 to 562 tok/s. They were opt-in while 2 of 9 cold streamed-against-
    resident compares gave other tokens; after the warm-up was joined before the tuner times (its
    router shared the split-K arrival counters), 10 cold compares and 8 streamed loads in one process
    all matched at logit error 0 (bench/NOTES.md, 2026-12-06). KILN_DP4A_PAIRS=0: the fma pairs."""
    if dp4a_ok and dp4a_pairs_on():
        v = ops.choose(kernels.OP, shape)
        if v.p.get("dp4a"):
            return v if v.p["sk"] == 1 else kernels.dp4a_variant(v.p["bn"], v.p["w"], v.p["r"], 1)
    return unsplit(kernels.OP.default(shape, ops.dev), shape)


def unsplit(v, shape):
    """An fma form without split-K for `shape`: v itself, or bn 16 with the step nearest 128 words
    that fits; None where none does."""
    if v.p.get("fma") and v.p["sk"] == 1:
        return v
    for bw in (128, 64, 256, 32, 16, 8, 4, 2):
        f = kernels.fma_variant(16, bw, 4, 1)
        if kernels.fits(shape, f.p):
            return f
    return None


def quant_act_down(ops, gu, w: QuantizedWeight, act: str):
    """Decode's down projection of act(g) * u on a quantised w, gu [1, 2I] = [g | u]: the tuned choice
    between act_mul then the GEMV and the GEMV computing act(g) * u as it loads x; None where the
    family is off or the input does not fit (the caller composes)."""
    gu2 = gu.reshape(-1, gu.shape[-1])
    if not ops.on("quant", gu) or not kernels.OP.supports_prologue(gu2, w, act=act):
        return None
    shape = kernels.QGemvShape(1, w.shape[0], w.shape[1], w.bits, w.group_size, act=act)
    y = gu2.new_empty((1, w.shape[0]))
    kernels.OP.run(ops.choose(kernels.OP, shape), {"x": gu2.contiguous(), "w": w, "act": act}, {"y": y}, ops.plan)
    return y.view(*gu.shape[:-1], w.shape[0])


def gate_up_act_form(ops, x, w: QuantizedWeight, act: str):
    """The tuned dp4a form computing decode's act(gate) * up as its gate|up GEMV stores (w [gate; up]),
    or None: the family off, the input does not fit, or the tuner kept the GEMV then act_mul."""
    x2 = x.reshape(-1, x.shape[-1])
    if not ops.on("quant", x) or not kernels.OP.supports_epilogue(x2, w, act):
        return None
    v = ops.choose(kernels.OP, kernels.QGemvShape(1, w.shape[0], w.shape[1], w.bits, w.group_size, out_act=act))
    return v if v.p.get("dp4a") else None


def quant_gate_up_act(ops, x, w: QuantizedWeight, act: str):
    """Decode's h [1, I] = act(x Wg^T) * (x Wu^T) in one launch where gate_up_act_form finds a form;
    else None (the caller composes: the GEMV, then act_mul or the down GEMV's prologue). On the 27B
    the down's act prologue loses to act_mul's own launch (bench/NOTES.md, 2026-12-05): every block
    computes act(g) * u over its K; here each output is computed once."""
    v = gate_up_act_form(ops, x, w, act)
    if v is None:
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = x2.new_empty((1, w.shape[0] // 2))
    kernels.OP.run(v, {"x": x2, "w": w, "out_act": act}, {"y": y}, ops.plan)
    return y.view(*x.shape[:-1], -1)


def norm_after_form(ops, x, w: QuantizedWeight, r, norm_w, style):
    """The tuned dp4a form computing decode's rmsnorm(r + x W^T) in its last block (s = r + x W^T written),
    or None: the family off, the inputs do not fit, or the tuner kept the GEMV then the norm's kernel."""
    x2, r2 = x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])
    if not ops.on("quant", x) or not kernels.OP.supports_norm_epilogue(x2, w, r2, norm_w, style):
        return None
    v = ops.choose(kernels.OP, kernels.QGemvShape(1, w.shape[0], w.shape[1], w.bits, w.group_size, out_norm=style))
    return v if v.p.get("dp4a") else None


def quant_linear_add_rmsnorm(ops, x, w: QuantizedWeight, r, norm_w, eps, style):
    """(s, h) at one row: s = r + x W^T and h = rmsnorm(s) in one launch where norm_after_form finds a
    form (what add_rmsnorm gives for r and the product); None where not (the caller computes the
    product, then its add + norm). The 27B's decode ran 129 add + norm kernels of ~4 us a token in
    its graph (bench/NOTES.md, 2026-12-06)."""
    v = norm_after_form(ops, x, w, r, norm_w, style)
    if v is None:
        return None
    x2, r2 = x.reshape(1, -1).contiguous(), r.reshape(1, -1).contiguous()
    h, s = x2.new_empty((1, w.shape[0])), x2.new_empty((1, w.shape[0]))
    kernels.OP.run(v, {"x": x2, "w": w, "out_r": r2, "out_w": norm_w, "out_eps": eps, "out_norm": style},
                   {"y": h, "s": s}, ops.plan)
    return s.view(r.shape), h.view(r.shape)


def quant_norm_linear(ops, x, r, norm_w, eps, style, w: QuantizedWeight):
    """(s, y) at one row: s = x + r (None without r) and y = rmsnorm(s or x) @ dequantize(w)^T, by the
    tuned choice between the rmsnorm kernel then the GEMV and the GEMV norming x as it loads it; None
    where the family is off or the input does not fit."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    r2 = None if r is None else r.reshape(-1, k)
    if not ops.on("quant", x) or not kernels.OP.supports_prologue(x2, w, norm_w=norm_w, style=style, r=r2):
        return None
    shape = kernels.QGemvShape(1, w.shape[0], k, w.bits, w.group_size, style=style, add=r is not None)
    inputs = {"x": x2.contiguous(), "norm_w": norm_w, "eps": eps, "style": style, "w": w}
    outputs = {"y": x2.new_empty((1, w.shape[0]))}
    if r2 is not None:
        inputs["r"], outputs["s"] = r2.contiguous(), torch.empty_like(x2)
    kernels.OP.run(ops.choose(kernels.OP, shape), inputs, outputs, ops.plan)
    s = None if r is None else outputs["s"].view(x.shape)
    return s, outputs["y"].view(*x.shape[:-1], w.shape[0])


def dense_decode_workloads(weights: dict, base) -> list:
    """`base` less its one-row GEMV workloads (ops gemm, rmsnorm_gemm, act_gemm, gemm_act) whose
    weight shape only quantised weights have, and its few-row moe workloads where every expert stack
    is quantised: decode runs those on the quantised kernels, so measuring their bf16 kernels would be
    load time spent for nothing (the 9B's LM head alone: 30 variants; the 397B's stacks: 16 GiB)."""
    quantised, dense = set(), set()
    for w in weights.values():
        if isinstance(w, QuantizedWeight) and w.packed.dim() == 2:
            quantised.add(tuple(w.shape))
        elif isinstance(w, torch.Tensor) and w.dim() == 2:
            dense.add(tuple(w.shape))
    only_quantised = quantised - dense

    def weight_shape(wl):
        s = wl.shape
        return (2 * s.n if wl.op.name == "gemm_act" else s.n, s.k)

    # routed experts on quantised stacks: up to GEMV_ROWS tokens run quant_moe (or the per-expert
    # reference), never the moe family's bf16 kernels, whose tuning would draw the stacks whole in f32
    q3 = {tuple(w.shape) for w in weights.values() if isinstance(w, QuantizedWeight) and w.packed.dim() == 3}
    d3 = {tuple(w.shape) for w in weights.values() if isinstance(w, torch.Tensor) and w.dim() == 3}  # conv1d too

    def quantised_experts(s) -> bool:
        stacks = {(s.e, 2 * s.i, s.h), (s.e, s.h, s.i)}
        return stacks <= q3 and not stacks & d3

    def unused(wl):
        if wl.op.name == "moe":
            return wl.shape.rows <= GEMV_ROWS and quantised_experts(wl.shape)
        return (wl.op.name in ("gemm", "rmsnorm_gemm", "act_gemm", "gemm_act")
                and wl.shape.rows == 1 and weight_shape(wl) in only_quantised)

    return [wl for wl in base if not unused(wl)]


def quant_workloads(weights: dict, base=(), act: str | None = None, cuda_c: bool = True,
                    norm_after: tuple[int, str] | None = None) -> list[tuple]:
    """(op, shape) at one row for each distinct 2-D quantised weight a model holds (what decode runs)
    and, where the dp4a pair mode would run (on, and the experts' activation `act` one it computes),
    one expert of each quantised [E, N, K] stack (the pair GEMVs then take that shape's tuned form:
    pair_form; the fma pairs take a default, nothing to tune), and the prologue forms of those the
    model's one-row norm and activation GEMVs (`base`: workloads of ops rmsnorm_gemm and act_gemm,
    matched to the weights by (n, k)) read, and, where kiln's CUDA C kernels run (`cuda_c`: only the
    dp4a forms compute it), the act epilogue of its gate|up GEMVs (gemm_act's) and, with `norm_after`
    (hidden size, norm style: a model whose projections into the residual stream are handed on to the
    add + norm after them, ops.linear_later), the norm epilogue of every weight with that many rows."""
    formats, pairs = {}, act in DP4A_ACTS and dp4a_pairs_on()
    for w in weights.values():      # an [E, N, K] expert stack: one expert's shape (the pair GEMVs' form)
        if isinstance(w, QuantizedWeight) and (w.packed.dim() == 2 or (w.packed.dim() == 3 and pairs)):
            formats.setdefault((w.shape[-2], w.shape[-1]), set()).add((w.bits, w.group_size))
    shapes = {kernels.QGemvShape(1, n, k, b, g) for (n, k), fs in formats.items() for b, g in fs}
    if cuda_c and norm_after is not None and norm_epilogue_on():
        d, style = norm_after
        shapes.update(kernels.QGemvShape(1, n, k, b, g, out_norm=style) for (n, k), fs in formats.items()
                      for b, g in fs if n == d and d % 8 == 0 and b in dp4a.BITS)
    for wl in base:
        s, name = wl.shape, wl.op.name
        if cuda_c and name == "gemm_act" and s.rows == 1 and s.act in kernels.ACTS:   # act epilogue, [gate; up]
            shapes.update(kernels.QGemvShape(1, 2 * s.n, s.k, b, g, out_act=s.act)
                          for b, g in formats.get((2 * s.n, s.k), ()) if b in dp4a.BITS)
        if name not in ("rmsnorm_gemm", "act_gemm") or s.rows != 1:
            continue
        for b, g in formats.get((s.n, s.k), ()):
            pro = {"act": s.act} if name == "act_gemm" else {"style": s.style, "add": s.add}
            shape = kernels.QGemvShape(1, s.n, s.k, b, g, **pro)
            if 32 % b == 0 and (name != "act_gemm" or s.act in kernels.ACTS):   # FMA form: whole words, a
                # kernel activation (tanh GELU stays in torch)
                shapes.add(shape)
    return [(kernels.OP, s) for s in sorted(shapes, key=lambda s: (s.key[:4], len(s.key), repr(s.key[4:])))]
