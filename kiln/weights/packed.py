"""kiln's packed model directory (docs/format.md): manifest.json, core.bin (every tensor but the routed
experts), experts/layer_XXX.bin (one fixed-stride, 4 KiB-aligned blob per expert), tokenizer files.
The tensors are stored as the model reads them (its sanitize already applied: fused experts, mlx-lm's
changes undone), quantised ones as their packed words, scales and biases.

`open_packed(dir, verify)` reads one as a `Checkpoint` (memory-mapped, lazy) after checking the
manifest, core.bin and, as each is first read ("lazy") or at once ("full"), the expert files against
the manifest's SHA-256; `verify_dir(dir)` checks every file without loading anything."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KilnError
from .checkpoint import Checkpoint
from .quantized import QuantizedWeight

FORMAT, VERSION = "kiln-packed", 1
MANIFEST, MANIFEST_HASH, CORE = "manifest.json", "manifest.sha256", "core.bin"
CORE_ALIGN, BLOB_ALIGN = 64, 4096       # a tensor's offset in core.bin; an expert blob's stride (direct I/O)
HASH_CHUNK = 8 << 20
VERIFY_MODES = ("full", "lazy", "off")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
          "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def is_packed_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file() and (path / CORE).is_file()


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def align(n: int, to: int) -> int:
    return -(-n // to) * to


# -- the manifest's tensor records ----------------------------------------------------------------

def part_record(t: torch.Tensor, offset: int) -> dict:
    return {"offset": offset, "nbytes": t.numel() * t.element_size(), "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape)}


def parts_of(w) -> dict[str, torch.Tensor]:
    """What a stored tensor is written as: itself, or a quantised weight's words, scales and biases."""
    if isinstance(w, QuantizedWeight):
        return {"weight": w.packed, "scales": w.scales, "biases": w.biases}
    return {"tensor": w}


def tensor_record(w, parts: dict[str, dict]) -> dict:
    rec = {"shape": list(w.shape), "parts": parts}
    if isinstance(w, QuantizedWeight):
        rec["quant"] = {"bits": w.bits, "group_size": w.group_size}
        if w.out_dtype is not None:
            rec["quant"]["out_dtype"] = DTYPE_NAMES[w.out_dtype]
    return rec


# -- reading -------------------------------------------------------------------------------------

@dataclass
class _Mapped:
    """A file mapped read-only once, its SHA-256 checked before first use (lazy) or at open (full)."""
    path: Path
    sha256: str | None
    mm: mmap.mmap | None = None
    checked: bool = False

    def buffer(self) -> mmap.mmap:
        if not self.checked and self.sha256 is not None:
            check_file(self.path, self.sha256)
        self.checked = True
        if self.mm is None:
            with open(self.path, "rb") as f:
                # copy-on-write, as the safetensors reader maps: kiln never writes a view
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.mm

    def view(self, rec: dict, base: int = 0, count: int = 1, stride: int = 0) -> torch.Tensor:
        """The part `rec` at `base` (in bytes), or `count` of them `stride` bytes apart stacked."""
        dtype, shape = DTYPES[rec["dtype"]], tuple(rec["shape"])
        mm = self.buffer()
        if rec["nbytes"] == 0:
            return torch.empty((count, *shape) if count > 1 else shape, dtype=dtype)
        start = base + rec["offset"]
        if count == 1:
            return torch.frombuffer(mm, dtype=torch.uint8, count=rec["nbytes"], offset=start).view(dtype).view(shape)
        span = (count - 1) * stride + rec["nbytes"]
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=span, offset=start).view(dtype)
        strides = [stride // dtype.itemsize] + [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return raw.as_strided((count, *shape), strides).contiguous()      # one host copy of the stack


def check_file(path: Path, want: str) -> None:
    if not path.is_file():
        raise KilnError(f"{path}: missing (the packed model is incomplete: run kiln verify)")
    if sha256_file(path) != want:
        raise KilnError(f"{path}: SHA-256 does not match the manifest (the file is damaged: run kiln verify)")


def read_manifest(d: Path, check: bool = True) -> dict:
    if not (d / MANIFEST).is_file():
        raise KilnError(f"{d}: not a kiln packed directory (no {MANIFEST})")
    raw = (d / MANIFEST).read_bytes()
    if check and (d / MANIFEST_HASH).is_file():
        if hashlib.sha256(raw).hexdigest() != (d / MANIFEST_HASH).read_text().split()[0]:
            raise KilnError(f"{d / MANIFEST}: SHA-256 does not match {MANIFEST_HASH} (the manifest is damaged)")
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise KilnError(f"{d / MANIFEST}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise KilnError(f"{d}: not a kiln packed model of version {VERSION} "
                        f"(format {m.get('format')!r}, version {m.get('version')!r})")
    return m


def open_packed(d: Path, verify: str = "lazy") -> Checkpoint:
    if verify not in VERIFY_MODES:
        raise KilnError(f"--verify takes {', '.join(VERIFY_MODES)}, not {verify!r}")
    m = read_manifest(d, check=verify != "off")
    digests = {name: f["sha256"] for name, f in m["files"].items()} if verify != "off" else {}
    files: dict[str, _Mapped] = {}

    def mapped(name: str) -> _Mapped:
        if name not in files:
            files[name] = _Mapped(d / name, digests.get(name))
        return files[name]

    if verify != "off":
        mapped(CORE).buffer()                      # the core and the layout are checked at open
    if verify == "full":
        for name in m["files"]:
            if name.startswith("experts/"):
                mapped(name).buffer()
    shapes = {n: tuple(r["shape"]) for n, r in m["tensors"].items()}
    stacks = {}
    for layer in m.get("experts", {}).get("layers", []):
        for n, r in layer["tensors"].items():
            shapes[n], stacks[n] = tuple(r["shape"]), layer

    def load(name: str):
        if name in stacks:
            layer = stacks[name]
            rec, f = layer["tensors"][name], mapped(layer["file"])
            got = {k: f.view(p, 0, layer["count"], layer["stride"]) for k, p in rec["parts"].items()}
        else:
            rec = m["tensors"][name]
            got = {k: mapped(CORE).view(p) for k, p in rec["parts"].items()}
        if "quant" in rec:
            q = rec["quant"]
            return QuantizedWeight(got["weight"], got["scales"], got["biases"], q["bits"], q["group_size"],
                                   DTYPES[q["out_dtype"]] if "out_dtype" in q else None)
        return got["tensor"]

    return Checkpoint(d, "packed", m["config"], shapes, load, m.get("generation", {}), sanitized=True)


def verify_dir(d: Path, progress=None) -> list[str]:
    """Every problem found, one line each (empty: the directory matches its manifest)."""
    try:
        m = read_manifest(d)
    except (KilnError, OSError) as e:
        return [str(e)]
    bad = []
    for name, f in m["files"].items():
        p = d / name
        if not p.is_file():
            bad.append(f"{name}: missing")
        elif p.stat().st_size != f["size"]:
            bad.append(f"{name}: {p.stat().st_size} bytes, the manifest says {f['size']}")
        elif sha256_file(p, progress) != f["sha256"]:
            bad.append(f"{name}: SHA-256 does not match the manifest")
    return bad
