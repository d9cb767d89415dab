"""HF folder: config.json + *.safetensors (single or sharded), memory-mapped; never unpickled."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import KilnError
from .checkpoint import Checkpoint, FileSpan
from .quantized import quantized_view

# Multimodal wrappers keep the text model under these prefixes; they map to ForCausalLM names.
_TEXT_PREFIXES = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KilnError(f"cannot read {path}: {e}") from None


def text_config(cfg: dict) -> tuple[dict, bool]:
    """The language model's config, and whether `cfg` was a multimodal wrapper."""
    if "text_config" not in cfg:
        return dict(cfg), False
    text = dict(cfg["text_config"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    return text, True


def canonical_name(name: str, wrapped: bool) -> str | None:
    """HF ForCausalLM name for a stored tensor name; None for non-text weights of a wrapper."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    if wrapped and name != "lm_head.weight":
        return None  # vision tower, projector, MTP head: not part of the text model
    return name


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise KilnError(f"{d}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return [d / f for f in files]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise KilnError(f"{d} has no *.safetensors files (kiln never loads pickled checkpoints)")
    return files


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class MappedSafetensors:
    """Tensors of a .safetensors file as views of its (copy-on-write) memory map: no host copy, so moving
    one to the GPU reads the page cache once (safetensors' get_tensor first copies into a new host
    tensor). Falls back to get_tensor for a tensor whose offset does not suit its dtype."""

    def __init__(self, path: Path, handle):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            self.header = json.loads(f.read(n))
            # copy-on-write: pages are read from the page cache as they are touched; a write (kiln
            # never writes a view, load_strict copies first) would change a private page, not the file
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base, self.handle, self.path = 8 + n, handle, path

    def span(self, name: str) -> FileSpan | None:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        start, end = info["data_offsets"]
        if dtype is None or end == start:
            return None
        return FileSpan(self.path, self.base + start, end - start, dtype, tuple(info["shape"]))

    def get(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _DTYPES.get(info["dtype"])
        start, end = info["data_offsets"]
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None else 0
        if dtype is None or (self.base + start) % size or end == start:
            return self.handle.get_tensor(name)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=end - start, offset=self.base + start)
        return raw.view(dtype).view(info["shape"])


def open_hf_dir(d: Path) -> Checkpoint:
    if not (d / "config.json").exists():
        raise KilnError(f"{d} has no config.json")
    config, wrapped = text_config(_read_json(d / "config.json"))
    handles, where, shapes = [], {}, {}
    for f in _shard_files(d):
        try:
            h = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise KilnError(f"cannot read {f}: {e}") from None
        try:
            mapped = MappedSafetensors(f, h)
        except (OSError, ValueError, struct.error):     # unusual file: safetensors' own reader
            mapped = None
        handles.append(h)
        for name in h.keys():
            canon = canonical_name(name, wrapped)
            if canon is not None:
                where[canon] = (h, mapped, name)
                shapes[canon] = tuple(h.get_slice(name).get_shape())

    def load(canon: str):
        """A view of the file's memory map where it can be one (see load_strict)."""
        h, mapped, name = where[canon]
        return mapped.get(name) if mapped is not None else h.get_tensor(name)

    def locate(canon: str) -> FileSpan | None:
        _, mapped, name = where[canon]
        return mapped.span(name) if mapped is not None else None

    gen_path = d / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    return quantized_view(Checkpoint(d, "hf", config, shapes, load, generation, locator=locate, located=load))
