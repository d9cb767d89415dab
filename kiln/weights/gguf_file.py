"""A small GGUF parser: metadata as Python values, tensors as memory-mapped byte views.

The `gguf` package's reader builds a numpy object per array element and takes seconds on a
262k-token vocabulary; this one parses the same file in a fraction of that. Format:
header (magic, version, counts), key/value metadata, tensor infos, aligned tensor data.

The bytes are untrusted. Every read is checked against the bytes left before it is made, and every
count against the bytes it needs before anything is built from it; value and tensor types must be
known ones; a tensor's shape must fit int64 and whole blocks of its type, and its data must start
aligned inside the file, end inside it and overlap no other tensor. Whatever fails raises
KilnError("<path>: not a valid GGUF file (<what is wrong>)"); nothing else is caught.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import KilnError

# GGUF value type -> (name, struct of one value, numpy dtype); 8 and 9 are string and array.
_SCALAR = {
    0: ("u8", "<B", "<u1"), 1: ("i8", "<b", "<i1"), 2: ("u16", "<H", "<u2"), 3: ("i16", "<h", "<i2"),
    4: ("u32", "<I", "<u4"), 5: ("i32", "<i", "<i4"), 6: ("f32", "<f", "<f4"), 7: ("bool", "<?", "?"),
    10: ("u64", "<Q", "<u8"), 11: ("i64", "<q", "<i8"), 12: ("f64", "<d", "<f8"),
}
_SCALAR = {t: (name, struct.Struct(fmt), np.dtype(dt)) for t, (name, fmt, dt) in _SCALAR.items()}
_STRING, _ARRAY = 8, 9
INT_TYPES = frozenset(("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"))   # value type names
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_MAX_DIMS = 4                   # GGML_MAX_DIMS
_INT64_MAX = (1 << 63) - 1      # element counts and offsets must fit torch's int64
# The fewest bytes one metadata entry (key length, type, a 1-byte value) and one tensor info (name
# length, dimension count, type, offset) can take: the counts in the header are checked with them.
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int        # gguf.GGMLQuantizationType value
    shape: tuple          # row-major (numpy) order: the reverse of GGUF's ne[]
    offset: int           # absolute byte offset in the file
    nbytes: int


class _Invalid(Exception):
    """What is wrong with the bytes; GGUFFile raises it as KilnError with the path."""


@lru_cache(maxsize=1)
def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml type number -> (elements per block, bytes per block), for every type gguf knows."""
    import gguf

    return {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}


def _show(text: str) -> str:
    """A key or tensor name from the file as an error message quotes it: escaped, at most 80 characters."""
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


class StringArray(Sequence):
    """A GGUF array of strings, decoded (UTF-8, bad bytes replaced) on first use; its length is known
    without decoding. GGUFFile has checked every length against the file, so decoding cannot fail."""

    def __init__(self, buf, start: int, count: int):
        self._buf, self._start, self._count, self._items = buf, start, count, None

    def _list(self) -> list[str]:
        if self._items is None:
            out, pos, unpack, buf = [], self._start, _U64.unpack_from, self._buf
            for _ in range(self._count):
                n = unpack(buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            self._items = out
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, StringArray)) and self._list() == list(other)

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class GGUFFile:
    """Parsed header of a GGUF file; `raw(name)` is a zero-copy uint8 view of one tensor.

    `metadata` maps each key to its value (lists for arrays); `value_types` maps it to the GGUF
    type it was stored as ("u32", "f32", "str", "array[str]", ...), so callers can check types.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
        except (OSError, ValueError) as e:
            raise KilnError(f"cannot read {self.path}: {e}") from None
        self._mm = np.frombuffer(self._map, dtype=np.uint8)     # read-only: tensors are views of it
        self._pos = 0
        try:
            self._parse()
        except _Invalid as e:
            raise KilnError(f"{self.path}: not a valid GGUF file ({e})") from None

    # -- bounded readers: each checks the bytes left before it reads ---------------------------
    def _take(self, n: int, what: str) -> int:
        """Start of the next `n` bytes (which hold `what`); moves past them."""
        left = self.size - self._pos
        if n > left:
            raise _Invalid(f"{what} needs {n} bytes at offset {self._pos}, but the file ends {left} bytes later")
        start = self._pos
        self._pos += n
        return start

    def _u32(self, what: str) -> int:
        return _U32.unpack_from(self._map, self._take(4, what))[0]

    def _u64(self, what: str) -> int:
        return _U64.unpack_from(self._map, self._take(8, what))[0]

    def _string(self, what: str) -> str:
        n = self._u64(f"the length of {what}")
        start = self._take(n, what)
        return self._map[start:start + n].decode("utf-8", errors="replace")

    def _strings(self, count: int, what: str) -> "StringArray":
        """An array of `count` strings. Only their lengths are walked here (each one checked by the read
        after it, the last against the file's end); the text is decoded on first use: a 262k-token
        vocabulary walks in ~25 ms and decodes in ~90, and opening a checkpoint (or a tokenizer from
        its cache) needs only its length."""
        buf, pos, end = self._map, self._pos, self.size
        if count > (end - pos) // 8:
            raise _Invalid(f"{what} claims {count} strings, more than the {end - pos} bytes left can hold")
        start, unpack, i = pos, _U64.unpack_from, 0
        try:    # a length that runs past the end makes the next read fail: one check a string is enough
            for i in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):
            raise _Invalid(f"string {i} of {what} runs past the end of the file") from None
        if pos > end:
            raise _Invalid(f"the last string of {what} runs past the end of the file")
        self._pos = pos
        return StringArray(buf, start, count)

    def _value(self, vtype: int, key: str):
        """(value, its type name) of metadata `key`, stored as GGUF type `vtype`."""
        shown = _show(key)
        if vtype == _STRING:
            return self._string(f"the value of {shown}"), "str"
        if vtype == _ARRAY:
            etype = self._u32(f"the element type of {shown}")
            count = self._u64(f"the length of {shown}")
            if etype == _STRING:
                return self._strings(count, shown), "array[str]"
            if etype not in _SCALAR:
                kind = "arrays of arrays are" if etype == _ARRAY else f"element type {etype} is"
                raise _Invalid(f"metadata {shown}: {kind} not a GGUF array type")
            name, st, dt = _SCALAR[etype]
            start = self._take(count * st.size, f"the {count} {name} values of {shown}")
            return np.frombuffer(self._map, dtype=dt, count=count, offset=start).tolist(), f"array[{name}]"
        if vtype not in _SCALAR:
            raise _Invalid(f"metadata {shown}: value type {vtype} is not a GGUF type")
        name, st, _ = _SCALAR[vtype]
        return st.unpack_from(self._map, self._take(st.size, f"the value of {shown}"))[0], name

    # -- the file ----------------------------------------------------------------------------
    def _parse(self) -> None:
        if self.size < 4 or self._map[:4] != b"GGUF":
            raise _Invalid("it does not start with the GGUF magic")
        self._pos = 4
        self.version = self._u32("the version")
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            raise _Invalid("a big-endian GGUF file; kiln reads little-endian ones" if swapped in (2, 3) else
                           f"version {self.version}; kiln reads versions 2 and 3")
        n_tensors, n_kv = self._u64("the tensor count"), self._u64("the metadata count")
        left = self.size - self._pos
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
            raise _Invalid(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the {left} bytes left")

        self.metadata: dict = {}
        self.value_types: dict[str, str] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            shown = _show(key)
            if key in self.metadata:
                raise _Invalid(f"metadata key {shown} appears twice")
            self.metadata[key], self.value_types[key] = self._value(self._u32(f"the type of {shown}"), key)

        infos = []
        for i in range(n_tensors):
            name = self._string(f"the name of tensor {i}")
            shown = _show(name)
            n_dims = self._u32(f"the dimension count of tensor {shown}")
            if n_dims > _MAX_DIMS:
                raise _Invalid(f"tensor {shown} has {n_dims} dimensions (GGUF allows at most {_MAX_DIMS})")
            ne = [self._u64(f"the shape of tensor {shown}") for _ in range(n_dims)]
            ttype = self._u32(f"the type of tensor {shown}")
            infos.append((name, ne, ttype, self._u64(f"the offset of tensor {shown}")))

        align = self.metadata.get("general.alignment", 32)
        if "general.alignment" in self.metadata and (
                self.value_types["general.alignment"] not in INT_TYPES or align <= 0 or align & (align - 1)):
            raise _Invalid(f"general.alignment is {align!r}, not a power of two")
        self.data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, ttype, off in infos:
            self.tensors[name] = self._tensor(name, ne, ttype, off, align)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise _Invalid(f"the data of tensors {_show(a)} and {_show(b)} overlap")

    def _tensor(self, name: str, ne: list[int], ttype: int, off: int, align: int) -> TensorInfo:
        shown = _show(name)
        if name in self.tensors:
            raise _Invalid(f"tensor {shown} appears twice")
        if ttype not in _block_sizes():
            raise _Invalid(f"tensor {shown} has type {ttype}, which is no ggml type")
        block, type_size = _block_sizes()[ttype]
        n = 1
        for d in ne:
            n *= d
        shape = tuple(reversed(ne))
        if n > _INT64_MAX:
            raise _Invalid(f"tensor {shown} of shape {shape} has more elements than int64 can count")
        if (ne and ne[0] % block) or n % block:
            raise _Invalid(f"tensor {shown} of shape {shape} is not a whole number of "
                           f"{_type_name(ttype)} blocks ({block} elements each) per row")
        nbytes = n // block * type_size
        if off % align:
            raise _Invalid(f"tensor {shown} is at data offset {off}, not a multiple of the alignment {align}")
        start = self.data_start + off
        if start + nbytes > self.size:
            raise _Invalid(f"tensor {shown} ({nbytes} bytes at offset {start}) runs past the end of the file "
                           f"({self.size} bytes)")
        return TensorInfo(name, ttype, shape, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self._mm[info.offset:info.offset + info.nbytes]
