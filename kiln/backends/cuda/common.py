"""What every kernel family shares: the device it runs on, interpreter mode, dtypes, tile helpers."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1): every step runs, timings mean nothing."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class DeviceInfo:
    """What the kernels and the tune cache need to know about the device."""
    name: str
    sms: int
    capability: tuple[int, int] | None     # None on CPU (interpreter)
    device: torch.device

    @property
    def tma(self) -> bool:
        """Hopper and later: tensor-memory-accelerator descriptors, persistent TMA GEMMs."""
        return self.capability is not None and self.capability >= (9, 0)


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(p.name, p.multi_processor_count, (p.major, p.minor), torch.device("cuda", index))


def device_info(device: torch.device | str) -> DeviceInfo:
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo("cpu (triton interpreter)", 4, None, device)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


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


SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
