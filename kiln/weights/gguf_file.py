"""A small GGUF parser: metadata as Python values, tensors as memory-mapped byte views.

The `gguf` package's reader builds a numpy object per array element and takes seconds on a
262k-token vocabulary; this one parses the same file in a fraction of that. Format:
header (magic, version, counts), key/value metadata, tensor infos, aligned tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KilnError

_SCALAR = {  # GGUF value type -> (struct format, numpy dtype)
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int        # gguf.GGMLQuantizationType value
    shape: tuple          # row-major (numpy) order: the reverse of GGUF's ne[]
    offset: int           # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; `raw(name)` is a zero-copy uint8 view of one tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise KilnError(f"cannot read {self.path}: {e}") from None
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise KilnError(f"{self.path} is not a valid GGUF file ({e})") from None

    # -- low-level readers --------------------------------------------------------------
    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        raw = bytes(self._buf[self._pos:self._pos + n])
        if len(raw) != n:
            raise ValueError("truncated string")
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            fmt, dt = _SCALAR[etype]
            size = struct.calcsize(fmt)
            arr = np.frombuffer(self._buf, dtype=np.dtype(dt).newbyteorder("<"), count=count, offset=self._pos)
            self._pos += size * count
            return arr.tolist()
        fmt, _ = _SCALAR[vtype]
        return self._unpack(fmt)

    def _parse(self) -> None:
        import gguf  # only for the per-type block sizes

        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("bad magic")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version < 2:
            raise ValueError(f"GGUF version {self.version} is not supported")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, ne, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ttype, off in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            n = int(np.prod(ne)) if ne else 1
            nbytes = n // block * type_size
            start = data_start + off
            if start + nbytes > len(self._mm):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors[name] = TensorInfo(name, ttype, tuple(int(d) for d in reversed(ne)), start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self._mm[info.offset:info.offset + info.nbytes]
