"""Checkpoint readers: an HF folder, a GGUF file, a kiln packed directory or a synthesized spec ->
config dict + tensors by canonical (HF) name.

`open_checkpoint(path)` returns a `Checkpoint` whose tensors load lazily (memory-mapped), so a
model asks for exactly the names it declares and strict loading can name what is missing or extra.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KilnError
from .checkpoint import Checkpoint, FileSpan
from .gguf import open_gguf
from .hf import open_hf_dir
from .packed import is_packed_dir, open_packed
from .synth import open_synth

__all__ = ["Checkpoint", "FileSpan", "open_checkpoint"]


def open_checkpoint(path: str | Path, verify: str = "lazy", keep: bool | None = None) -> Checkpoint:
    """`verify` (full, lazy, off): how a packed directory's files are checked against its manifest;
    `keep`: a GGUF file's 32-block tensors kept quantised (None: KILN_KEEP_QUANTIZED decides)."""
    if str(path).startswith("synth:"):  # seeded random weights, drawn as they are loaded
        return open_synth(str(path))
    p = Path(path).expanduser()
    if not p.exists():
        raise KilnError(f"no such model file or folder: {p}")
    if is_packed_dir(p):
        return open_packed(p, verify)
    if p.is_dir():
        return open_hf_dir(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return open_gguf(p, keep)
    raise KilnError(f"{p} is neither a GGUF file nor an HF folder (config.json + *.safetensors)")
