"""The device a kernel runs on, as the kernels and the tune cache see it (no Triton import)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


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
