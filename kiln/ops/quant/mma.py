"""The one-row quantised GEMV on the tensor cores (2- and 4-bit in bf16, 2-, 4- and 8-bit in f16).

The FMA form (kernels.py) spends about 5 instructions a weight on the CUDA cores; a GEMV that reads
4.5 bits a weight at the HBM bound leaves about 4.4 (bench/NOTES.md). Here each value costs about
one: a 32-bit word's two 16-bit lanes become two 16-bit floats 1 + q / 2^bits (q moved to the top of
the mantissa under 1.0's exponent: one shift and one AND-OR for two values), and the dot products
run on the tensor cores, where a weight costs next to nothing.

The groups' scales cannot enter a tensor-core product row by row, so the product is taken per group:
the right-hand operand is x laid out block-diagonally, column c holding x's values of group c of the
chunk and zeros elsewhere, so D[row, c] = sum over group c of (1 + q / 2^bits) x. Then, per (row,
group), dot(q, x) = 2^bits (D - sum(x)) and y += scale * dot(q, x) + bias * sum(x), once a group, in
f32 (the 1 costs at most a bit or two of D's f32 to cancellation; q in the mantissa's low bits cost
f16 ten). bf16 holds q of 2 and 4 bits this way, f16 of 8 too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import pdl_wait, round_to
from ..gemm.gemm import gemv_splitk_finish

NC = tl.constexpr(16)      # groups a chunk: the dot's N (its smallest)


def lop3_asm(bits: int, mant: int) -> str:
    """PTX for unpack_asm: output j of a 32-bit register of two 16-bit lanes is field j of each lane
    moved to the top `bits` of a `mant`-bit mantissa (one shift; the mask keeps the halves apart)
    under 1.0's exponent (input 1: two copies of it), so each half is the float 1 + q / 2^bits."""
    per, mask = 16 // bits, ((1 << bits) - 1) << (mant - bits)
    mask *= 0x10001
    lines = []
    for j in range(per):
        sh = mant - bits - bits * j
        src = f"${per}"
        if sh:
            lines.append(f"{'shl' if sh > 0 else 'shr'}.b32 t, ${per}, {abs(sh)};")
            src = "t"
        lines.append(f"lop3.b32 ${j}, {src}, {mask:#010x}, ${per + 1}, 0xea;")
    return "{\n.reg .b32 t;\n" + "\n".join(lines) + "\n}"


ASM2_BF16 = tl.constexpr(lop3_asm(2, 7))
ASM4_BF16 = tl.constexpr(lop3_asm(4, 7))
ASM2_F16 = tl.constexpr(lop3_asm(2, 10))
ASM4_F16 = tl.constexpr(lop3_asm(4, 10))
ASM8_F16 = tl.constexpr(lop3_asm(8, 10))


@triton.jit
def unpack_asm(w16, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """Each 16-bit lane's 16 / BITS values (LSB first) as the 16-bit floats 1 + q / 2^BITS (MAGIC:
    1.0's bits; 0x3F80 bf16, 0x3C00 f16), two lanes an instruction pair (PTX shift and lop3 on a
    32-bit register), as [..., 16 / BITS] in value order."""
    magic = tl.full(w16.shape, MAGIC, tl.int16)
    if BITS == 4:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(ASM4_BF16 if MAGIC == 0x3F80 else ASM4_F16, "=r,=r,=r,=r,r,r",
                                                   [w16, magic], (tl.int16, tl.int16, tl.int16, tl.int16), True, 2)
        v = tl.join(tl.join(o0, o2), tl.join(o1, o3))
    elif BITS == 8:
        o0, o1 = tl.inline_asm_elementwise(ASM8_F16, "=r,=r,r,r", [w16, magic], (tl.int16, tl.int16), True, 2)
        v = tl.join(o0, o1)
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            ASM2_BF16 if MAGIC == 0x3F80 else ASM2_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w16, magic],
            (tl.int16,) * 8, True, 2)
        v = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    return tl.reshape(v, [w16.shape[0], w16.shape[1], 16 // BITS])


@triton.jit
def unpack_plain(w16, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """unpack_asm in Triton's integer ops (the interpreter runs no PTX): the same values."""
    PER: tl.constexpr = 16 // BITS
    TOP: tl.constexpr = (7 if MAGIC == 0x3F80 else 10) - BITS      # q's lowest bit in the mantissa
    shifts = tl.arange(0, PER) * BITS
    v = (w16.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return ((v << TOP) | MAGIC).to(tl.int16)


@triton.jit
def weight_tile(q16_ptr, rows, h0, H16: tl.constexpr, BN: tl.constexpr, SPAN: tl.constexpr,
                BITS: tl.constexpr, MAGIC: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """[BN, SPAN] weights of `rows` from 16-bit lane h0 as MAGIC | q floats of type DT."""
    PER: tl.constexpr = 16 // BITS
    lanes = tl.load(q16_ptr + rows[:, None] * H16 + h0 + tl.arange(0, SPAN // PER)[None, :])
    if ASM:
        v = unpack_asm(lanes, BITS, MAGIC)
    else:
        v = unpack_plain(lanes, BITS, MAGIC)
    # [BN, lanes, PER] -> [BN, PER, lanes]: value j of consecutive lanes share a register (as lop3
    # left them), so column k' = j * lanes + h holds the row's value PER * h + j
    return tl.reshape(tl.permute(v, (0, 2, 1)), [BN, SPAN]).to(DT, bitcast=True)


@triton.jit
def chunk_x(x_ptr, m, c0, K: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr, TILES: tl.constexpr,
            BITS: tl.constexpr):
    """x of groups c0 .. c0 + TILES * SUB as TILES columns in weight_tile's column order [SPAN, TILES],
    and the group sums [NC] (zeros past the last): loaded a chunk ahead, so the gather's latency
    hides behind the products (ncu: these loads were the kernel's largest stall)."""
    PER: tl.constexpr = 16 // BITS
    SPAN: tl.constexpr = SUB * G
    kk = tl.arange(0, SPAN)
    phys = PER * (kk % (SPAN // PER)) + kk // (SPAN // PER)
    tcol = tl.arange(0, NC // SUB)          # a full chunk's tiles (a power of two); TILES of them live
    xv = tl.load(x_ptr + m * K + c0 * G + tcol[None, :] * SPAN + phys[:, None], mask=(tcol < TILES)[None, :],
                 other=0.0)
    cols = tl.arange(0, NC)
    live = cols < TILES * SUB
    xs = tl.sum(tl.load(x_ptr + m * K + (c0 + cols)[:, None] * G + tl.arange(0, G)[None, :], mask=live[:, None],
                        other=0.0).to(tl.float32), axis=1)
    return xv, xs


@triton.jit
def chunk_sums(xv, xs, q16_ptr, s_ptr, b_ptr, rows, c0, K: tl.constexpr, GROUPS: tl.constexpr,
               G: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr, TILES: tl.constexpr, BITS: tl.constexpr,
               ASM: tl.constexpr):
    """scale * dot(q, x) + bias * sum(x) of groups c0 .. c0 + TILES * SUB of `rows`, as [BN, NC] (a
    column a group, zeros past the last): TILES products of SUB groups into one [BN, NC] tile, then
    the scales and biases once a (row, group). xv, xs: chunk_x's."""
    DT: tl.constexpr = xv.dtype
    MAGIC: tl.constexpr = 0x3F80 if DT == tl.bfloat16 else 0x3C00      # 1.0
    PER: tl.constexpr = 16 // BITS
    SPAN: tl.constexpr = SUB * G
    cols = tl.arange(0, NC)
    kk = tl.arange(0, SPAN)
    phys = PER * (kk % (SPAN // PER)) + kk // (SPAN // PER)       # weight_tile's column order
    tcol = tl.arange(0, NC // SUB)
    d = tl.zeros((BN, NC), dtype=tl.float32)
    for t in tl.static_range(TILES):
        g0 = c0 + t * SUB
        xt = tl.sum(tl.where(tcol[None, :] == t, xv.to(tl.float32), 0.0), axis=1)       # column t, exact
        xb = tl.trans(tl.where(cols[:, None] == (t * SUB + phys // G)[None, :], xt[None, :], 0.0).to(DT))
        w = weight_tile(q16_ptr, rows, g0 * (G // PER), K // PER, BN, SPAN, BITS, MAGIC, DT, ASM)
        if ASM:
            d = tl.dot(w, xb, d)
        else:       # the interpreter's dot multiplies bf16 as raw bits: exact in f32 too
            d = tl.dot(w.to(tl.float32), xb.to(tl.float32), d)
    grp = c0 + cols
    sb = rows[:, None] * GROUPS + grp[None, :]
    if TILES * SUB == NC:       # unmasked, so the loads are vectors Triton pipelines
        scale = tl.load(s_ptr + sb).to(tl.float32)
        bias = tl.load(b_ptr + sb).to(tl.float32)
    else:
        live = cols < TILES * SUB
        scale = tl.load(s_ptr + sb, mask=live[None, :], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + sb, mask=live[None, :], other=0.0).to(tl.float32)
    return (scale * (1 << BITS)) * (d - xs[None, :]) + bias * xs[None, :]


@triton.jit(do_not_specialize=["M"])
def qgemv_mma_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr,
                     BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr,
                     SPLIT_K: tl.constexpr, RNE: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (column block, split) takes BN rows over its share of the groups: chunk_sums of NC
    groups at a time, then a last chunk of the products left (no branch in the loop: Triton
    pipelines its loads), reduced once a row."""
    GROUPS: tl.constexpr = K // G
    GS: tl.constexpr = GROUPS // SPLIT_K              # groups a split (fits() makes it whole products)
    FULL: tl.constexpr = GS // NC.value
    TAIL: tl.constexpr = (GS % NC.value) // SUB
    pid_n, split = tl.program_id(0), tl.program_id(1)
    q16_ptr = q_ptr.to(tl.pointer_type(tl.int16))
    rn = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(rn, N - 1).to(tl.int64)        # rows past N read row N-1, never stored
    start = split * GS
    pdl_wait(PDL)
    for m32 in range(0, M):
        m = tl.cast(m32, tl.int64)
        tot = tl.zeros((BN, NC), dtype=tl.float32)
        if FULL > 0:
            last = start + (FULL - 1) * NC         # the last full chunk: the prefetch past it reloads it
            xv, xs = chunk_x(x_ptr, m, start, K, G, SUB, NC // SUB, BITS)
            for c0 in range(start, start + FULL * NC, NC):
                xv_next, xs_next = chunk_x(x_ptr, m, tl.minimum(c0 + NC, last), K, G, SUB, NC // SUB, BITS)
                tot += chunk_sums(xv, xs, q16_ptr, s_ptr, b_ptr, rows, c0, K, GROUPS, G, BN, SUB, NC // SUB, BITS,
                                  ASM)
                xv, xs = xv_next, xs_next
        if TAIL > 0:
            xv, xs = chunk_x(x_ptr, m, start + FULL * NC, K, G, SUB, TAIL, BITS)
            tot += chunk_sums(xv, xs, q16_ptr, s_ptr, b_ptr, rows, start + FULL * NC, K, GROUPS, G, BN, SUB, TAIL,
                              BITS, ASM)
        total = tl.sum(tot, axis=1)
        if SPLIT_K == 1:
            tl.store(y_ptr + m * N + rn, round_to(total, y_ptr.dtype.element_ty, RNE), mask=rn < N)
        else:
            tl.store(ws_ptr + (split * M + m) * N + rn, total, mask=rn < N)
    if SPLIT_K > 1:
        gemv_splitk_finish(ws_ptr, y_ptr, count_ptr, pid_n, rn, M, N, BN, SPLIT_K, RNE)
