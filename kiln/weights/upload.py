"""Weights to the GPU through pinned staging buffers (KILN_PINNED_UPLOAD=1; off by default until
measured on a GPU: bench/h200_next.sh load9pin).

A tensor that views the file's memory map is pageable memory: `.to("cuda")` copies it through the
driver's own small staging buffers at a few GB/s (17.9 GB in ~5 s on the H200 machine). Here the
CPU copies each tensor, in chunks, into one of two pinned buffers while the copy engine moves the
other one to the GPU, so the host memcpy and the DMA overlap. A buffer is reused only after the
event recorded behind its last DMA has completed. The dtype conversion, if any, runs on the GPU.
"""

from __future__ import annotations

import os

import torch

CHUNK_BYTES = 256 << 20


def pinned_upload_on(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get("KILN_PINNED_UPLOAD", "0") not in ("", "0")


class Uploader:
    """upload(cpu_tensor, dtype) -> the tensor on `device` in `dtype`; finish() before the weights
    are used (it waits for the last copies). pin=False (CPU tests) runs the same chunking with plain
    buffers and blocking copies."""

    def __init__(self, device, chunk_bytes: int = CHUNK_BYTES, pin: bool = True):
        self.device, self.chunk = torch.device(device), chunk_bytes
        self.bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.events: list = [None, None]
        self.turn = 0
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def upload(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = src.contiguous()
        raw = src.reshape(-1).view(torch.uint8)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        dst = out.reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), self.chunk):
            n = min(self.chunk, raw.numel() - start)
            self._copy(raw[start:start + n], dst[start:start + n])
        if dtype == src.dtype:
            return out
        self._drain()
        return out.to(dtype)

    def _copy(self, part: torch.Tensor, dst: torch.Tensor) -> None:
        i = self.turn
        self.turn ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()          # its previous DMA is done: the buffer may be refilled
        buf = self.bufs[i][:part.numel()]
        buf.copy_(part)
        if self.stream is None:
            dst.copy_(buf)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(buf, non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record(self.stream)

    def _drain(self) -> None:
        """Wait for every copy issued so far (before a conversion that reads the destination)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def finish(self) -> None:
        if self.stream is not None:
            self._drain()
            self.stream.synchronize()
