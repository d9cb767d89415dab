"""Model families, chosen from the config's `model_type` through a table."""

from __future__ import annotations

import importlib

from ..errors import KilnError
from .base import config_from_dict, load_strict

# model_type -> (module, class); one file per family
MODEL_TYPES = {
    "llama": ("llama", "Llama"),
    "gemma3_text": ("gemma3", "Gemma3"),
    "gemma4_text": ("gemma4", "Gemma4"),
    "qwen3": ("qwen3", "Qwen3"),
    "qwen3_5_text": ("qwen3_5", "Qwen35"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen35Moe"),
    "qwen3_next": ("qwen3_next", "Qwen3Next"),
}


def model_class(model_type: str):
    if model_type not in MODEL_TYPES:
        raise KilnError(f"model type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})")
    module, cls = MODEL_TYPES[model_type]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_model(ckpt, ops, dtype, device, progress: bool = False):
    """Config from the checkpoint, weights loaded strictly, forward bound to `ops`."""
    cls = model_class(ckpt.config.get("model_type"))
    cfg = config_from_dict(cls.config_class, ckpt.config)
    ckpt = cls.sanitize(ckpt)
    weights = load_strict(ckpt, cls.weight_shapes(cfg), dtype, device, tied=cls.tied_names(cfg), progress=progress)
    return cls(cfg, weights, ops)
