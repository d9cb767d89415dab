"""Model families, chosen from the config's `model_type` through a table."""

from __future__ import annotations

import importlib

from ..errors import KilnError
from ..weights.synth import Synthesis, synth_config
from .base import config_from_dict, load_strict, merge_packed

# model_type -> (module, class); one file per family
MODEL_TYPES = {
    "llama": ("llama", "Llama"),
    "gemma3_text": ("gemma3", "Gemma3"),
    "gemma4_text": ("gemma4", "Gemma4"),
    "qwen3": ("qwen3", "Qwen3"),
    "qwen3_5_text": ("qwen3_5", "Qwen35"),
    "qwen3_5": ("qwen3_5", "Qwen35"),   # a flat config of the wrapper's type (mlx-lm writes these): the text model
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen35Moe"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen35Moe"),
    "qwen3_next": ("qwen3_next", "Qwen3Next"),
}


def model_class(model_type: str):
    if model_type not in MODEL_TYPES:
        raise KilnError(f"model type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})")
    module, cls = MODEL_TYPES[model_type]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def model_config(config: dict):
    """(model class, its config dataclass) for an HF-style config dict."""
    cls = model_class(config.get("model_type"))
    return cls, config_from_dict(cls.config_class, config)


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of this config holds, by name (tied weights left out)."""
    cls, cfg = model_config(config)
    return cls.checkpoint_shapes(cfg)


def synthesis(name: str, layers: int | None = None, seed: int = 0, skew: float = 0.0) -> Synthesis:
    """The named synthesized configuration (cut to its first `layers` layers) with the tensors its
    model declares: what `kiln synth` writes (`skew`: routing skew, weights/synth.router_scales)."""
    config = synth_config(name, layers)
    cls, cfg = model_config(config)
    return Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed, skew)


def build_model(ckpt, ops, dtype, device, progress: bool = False, experts=None):
    """Config from the checkpoint, weights loaded strictly, packed projections merged, forward bound
    to `ops`. `experts` (an ExpertPlan): the routed experts streamed through an ExpertStore (the
    model holds its handles; `model.expert_store` is the store) instead of loaded."""
    cls, cfg = model_config(ckpt.config)
    ckpt = ckpt.for_model(cls.checkpoint_shapes(cfg), cls.norm_style == "offset")
    if not ckpt.sanitized:
        ckpt = cls.sanitize(ckpt)
    shapes = cls.weight_shapes(cfg)
    store, skip = None, frozenset()
    if experts is not None:
        store, handles = experts.store(ckpt, shapes, dtype, device)
        skip = frozenset(handles)
    weights = load_strict(ckpt, shapes, dtype, device, tied=cls.tied_names(cfg), progress=progress, skip=skip)
    if store is not None:
        weights.update(handles)
    merge_packed(weights, cls.packed_groups(cfg))
    model = cls(cfg, weights, ops)
    model.expert_store = store
    return model
