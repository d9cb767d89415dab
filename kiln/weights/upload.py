"""Weights to the GPU through pinned staging buffers (on for CUDA; KILN_PINNED_UPLOAD=0 turns it off).

A tensor that views the file's memory map is pageable memory: `.to("cuda")` copies it through the
driver's own small staging buffers at a few GB/s. Here each
tensor goes, in chunks, into one of two pinned buffers while the copy engine moves the other one to
the GPU, so filling and DMA overlap. A buffer is reused only after the event recorded behind its
last DMA has completed. The dtype conversion, if any, runs on the GPU.

KILN_UPLOAD_READ=1: where the checkpoint says where a tensor's bytes lie in its file (a FileSpan),
threads pread them straight into the pinned buffer instead of copying from the memory map. From a
warm page cache that was slower (bench/NOTES.md), so it is off by default; it may pay on a cold disk.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import KilnError
from .quantized import QuantizedWeight

CHUNK_BYTES = 256 << 20
READ_THREADS = min(16, os.cpu_count() or 1)
PIECE_BYTES = 8 << 20      # the smallest read one thread is given


def pinned_upload_on(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get("KILN_PINNED_UPLOAD", "1") not in ("", "0")


def file_reads_on() -> bool:
    return os.environ.get("KILN_UPLOAD_READ", "0") not in ("", "0")


def pread_full(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset` (pread may return less than asked)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise KilnError(f"checkpoint file ended early ({offset + done} bytes): is it truncated?")
        done += n


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
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.pool: ThreadPoolExecutor | None = None
        self.fds: dict = {}

    def upload(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = src.contiguous()
        raw = src.reshape(-1).view(torch.uint8)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        dst = out.reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), self.chunk):
            n = min(self.chunk, raw.numel() - start)
            self._copy(lambda buf, i, a=start, n=n: buf.copy_(raw[a:a + n]), n, dst[start:start + n])
        return self._convert(out, dtype)

    def upload_span(self, span, dtype: torch.dtype) -> torch.Tensor:
        """The tensor a FileSpan describes, read from its file straight into the pinned buffers."""
        out = torch.empty(span.shape, dtype=span.dtype, device=self.device)
        dst = out.reshape(-1).view(torch.uint8)
        if dst.numel() != span.nbytes:
            raise KilnError(f"{span.path}: a tensor of shape {span.shape} cannot take {span.nbytes} bytes")
        fd = self._fd(span.path)
        for start in range(0, span.nbytes, self.chunk):
            n = min(self.chunk, span.nbytes - start)
            self._copy(lambda buf, i, a=start, n=n: self._read(fd, i, n, span.offset + a), n, dst[start:start + n])
        return self._convert(out, dtype)

    def _convert(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype == out.dtype:
            return out
        self._drain()
        return out.to(dtype)

    def _fd(self, path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def _read(self, fd: int, i: int, n: int, offset: int) -> None:
        """n bytes at offset into buffer i, in pieces read by parallel threads (pread drops the GIL)."""
        step = max(PIECE_BYTES, -(-n // READ_THREADS))
        pieces = [(a, min(a + step, n)) for a in range(0, n, step)]
        if len(pieces) == 1:
            pread_full(fd, self.views[i][:n], offset)
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kiln-read")
        for f in [self.pool.submit(pread_full, fd, self.views[i][a:b], offset + a) for a, b in pieces]:
            f.result()

    def _copy(self, fill, n: int, dst: torch.Tensor) -> None:
        """fill(buffer view, buffer index) writes n bytes into a free staging buffer; then DMA them."""
        i = self.turn
        self.turn ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()          # its previous DMA is done: the buffer may be refilled
        buf = self.bufs[i][:n]
        fill(buf, i)
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
        if self.pool is not None:
            self.pool.shutdown()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def placed(stored, dtype, device, uploader=None):
    """A stored tensor as the model holds it: on `device` in `dtype`; a quantised one's words as they
    are, its scales and biases in `dtype` (f32 ones kept f32, the weight computing in `dtype`). The
    expert store converts the experts it streams with this too (bit-exact copies of resident ones)."""
    if isinstance(stored, QuantizedWeight):   # the words as they are; scales and biases in `dtype`
        place = lambda t, dt: _place(t, dt, device, uploader)  # noqa: E731
        # f32 scales stay f32 (GGUF's: dequantising them in `dtype` would not be exact); computed in `dtype`
        sdt = torch.float32 if stored.scales.dtype == torch.float32 and stored.out_dtype is None else dtype
        return QuantizedWeight(place(stored.packed, stored.packed.dtype), place(stored.scales, sdt),
                               place(stored.biases, sdt), stored.bits, stored.group_size,
                               dtype if sdt != dtype else None)
    return _place(stored, dtype, device, uploader)


def _place(stored: torch.Tensor, dtype, device, uploader) -> torch.Tensor:
    if uploader is not None and stored.device.type == "cpu":
        return uploader.upload(stored, dtype)
    w = stored.to(device=device, dtype=dtype)    # to the GPU straight from the file's pages
    if w.data_ptr() == stored.data_ptr() and w.device.type == "cpu":
        w = w.clone()        # a read-only view of the file (same device and dtype): own a copy
    return w
