"""HF folder: config.json + *.safetensors (single or sharded), memory-mapped; never unpickled."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ..errors import KilnError
from . import Checkpoint

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
        handles.append(h)
        for name in h.keys():
            canon = canonical_name(name, wrapped)
            if canon is not None:
                where[canon] = (h, name)
                shapes[canon] = tuple(h.get_slice(name).get_shape())

    def load(canon: str):
        h, name = where[canon]
        return h.get_tensor(name)

    gen_path = d / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    return Checkpoint(d, "hf", config, shapes, load, generation)
