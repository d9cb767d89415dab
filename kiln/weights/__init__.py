"""Checkpoint readers: an HF folder or a GGUF file -> config dict + tensors by canonical (HF) name.

`open_checkpoint(path)` returns a `Checkpoint` whose tensors load lazily (memory-mapped), so a
model asks for exactly the names it declares and strict loading can name what is missing or extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import KilnError


@dataclass
class Checkpoint:
    path: Path
    format: str                                   # "hf" | "gguf" | "synth"
    config: dict                                  # HF-style text config (model_type, sizes, ...)
    shapes: dict[str, tuple[int, ...]]            # canonical name -> shape
    loader: Callable[[str], torch.Tensor]         # canonical name -> tensor (stored or f32 dtype)
    generation: dict = field(default_factory=dict)  # generation_config.json or GGUF equivalents
    gguf_metadata: dict | None = None             # raw GGUF key/values (tokenizer, template)
    locator: Callable[[str], "FileSpan | None"] | None = None   # where a tensor's bytes lie, if plain
    located: Callable | None = None               # the loader the locator describes

    def load(self, name: str) -> torch.Tensor:
        return self.loader(name)

    def locate(self, name: str) -> "FileSpan | None":
        """The tensor's bytes as a span of one file (stored dtype, row-major), or None where the
        reader must convert them (GGUF quantisation, synth): the upload then reads the file itself."""
        if self.locator is None or self.loader is not self.located:
            return None     # a wrapper changed what the tensors are (dataclasses.replace(loader=...))
        return self.locator(name)


@dataclass(frozen=True)
class FileSpan:
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def open_checkpoint(path: str | Path) -> Checkpoint:
    if str(path).startswith("synth:"):  # seeded random weights, drawn as they are loaded
        from ..synth import open_synth
        return open_synth(str(path))
    p = Path(path).expanduser()
    if not p.exists():
        raise KilnError(f"no such model file or folder: {p}")
    if p.is_dir():
        from .hf import open_hf_dir
        return open_hf_dir(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from .gguf import open_gguf
        return open_gguf(p)
    raise KilnError(f"{p} is neither a GGUF file nor an HF folder (config.json + *.safetensors)")
