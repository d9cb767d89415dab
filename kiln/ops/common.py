"""What every kernel family shares: dtypes, tile helpers, rounding, programmatic dependent launch, and
the launch options some kernels need."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..fsutil import cache_dir
from ..tune.device import interpreting

COMMON = __file__     # every op's kernels use helpers from here: part of each op's sources hash


def _default_triton_cache() -> None:
    """Compiled kernels live beside the tune cache ($KILN_CACHE_DIR/triton) unless TRITON_CACHE_DIR
    says otherwise: a warm kiln cache then loads without compiling anything."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir() / "triton")


_default_triton_cache()


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def pow2_dim(n: int) -> bool:
    """A head or state dimension the tiled kernels take: a power of two, at least 16."""
    return n >= 16 and n & (n - 1) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_flags(dtype: torch.dtype) -> dict:
    """UPCAST: the interpreter mishandles 16-bit tl.dot, so it upcasts there (never on the GPU).
    IEEE: f32 operands multiply in full f32, not tf32 (f32 is the CPU/test dtype)."""
    return {"UPCAST": interpreting() and dtype != torch.float32, "IEEE": dtype == torch.float32}


def rne_flag(dtype: torch.dtype) -> bool:
    """RNE: the interpreter truncates f32 -> bf16; kernels round to nearest even by hand there."""
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def round_to(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """x (f32) rounded to `dtype`. The GPU cast rounds to nearest even; under the interpreter
    (RNE) the bits are rounded first so that its truncating cast is exact (f32 to bf16 only)."""
    if RNE and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor) -> dict:
    """Launch options for programmatic dependent launch (sm_90 and later; KILN_PDL=0 turns it off):
    the kernel may start while the one before it finishes, loads what that kernel does not write
    (weights, its own state), and waits in pdl_wait before touching anything else."""
    on = (t.is_cuda and not interpreting() and os.environ.get("KILN_PDL", "1") != "0"
          and _pdl_capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible, then let the next one
    launch. Every PDL kernel passes here before it writes: so when a kernel starts, every kernel but
    the one just before it has finished, and only that one's outputs must not be read earlier."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# The kernels that round a product to 16 bits and then add it, as the reference does: by default
# Triton narrows both steps to 16-bit ops and contracts them into one FMA, which skips that rounding
# (tools/cross_compile.py fails on any 16-bit FMA; docs/compiler.md). f32 FMAs elsewhere stay: they
# skip no rounding the reference does.
EXACT_ROUNDING = {"enable_fp_fusion": False}
