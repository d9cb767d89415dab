"""A checkpoint as the readers present it: config, tensor shapes by canonical (HF) name, a loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Checkpoint:
    path: Path
    format: str                                   # "hf" | "gguf" | "synth" | "packed"
    config: dict                                  # HF-style text config (model_type, sizes, ...)
    shapes: dict[str, tuple[int, ...]]            # canonical name -> shape
    loader: Callable[[str], torch.Tensor]         # canonical name -> tensor (stored or f32 dtype)
    generation: dict = field(default_factory=dict)  # generation_config.json or GGUF equivalents
    gguf_metadata: dict | None = None             # raw GGUF key/values (tokenizer, template)
    locator: Callable[[str], "FileSpan | None"] | None = None   # where a tensor's bytes lie, if plain
    located: Callable | None = None               # the loader the locator describes
    drawn: Callable[[dict, bool], "Checkpoint"] | None = None   # synthesized: see for_model
    sanitized: bool = False                       # stored as the model reads it (a packed dir): no sanitize

    def for_model(self, shapes: dict[str, tuple[int, ...]], norm_offset: bool) -> "Checkpoint":
        """The checkpoint as a model reads it: a file's is itself; a synthesized one draws exactly the
        tensors the model declares (`shapes`), its norm weights zero-centred where `norm_offset`."""
        return self if self.drawn is None else self.drawn(shapes, norm_offset)

    def load(self, name: str) -> torch.Tensor:
        return self.loader(name)

    def locate(self, name: str) -> "FileSpan | None":
        """Where the tensor's bytes lie as stored (row-major): a FileSpan of one file (the upload reads
        it directly), a span of a URL or of the draw that yields them in pieces (kiln pack copies them
        a window at a time); None where the reader must convert them (GGUF, mlx-lm's changes)."""
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
