"""What every model file shares: config from a dict, strict weight loading, the Model protocol."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import KilnError


def config_from_dict(cls, d: dict[str, Any]):
    """Fill dataclass `cls` from an HF config dict, keeping only the keys it knows."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise KilnError(f"model config lacks {', '.join(missing)}")
    return cls(**{k: v for k, v in d.items() if k in names})


def load_strict(ckpt, expected: dict[str, tuple[int, ...]], dtype, device, tied: tuple[str, ...] = ()):
    """Tensors for exactly the `expected` names: anything missing, extra or mis-shaped is an error.
    `tied` names may be absent (they alias another weight)."""
    extra = sorted(set(ckpt.shapes) - set(expected))
    if extra:
        raise KilnError(f"unexpected tensor in checkpoint: {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    weights = {}
    for name, shape in expected.items():
        if name not in ckpt.shapes:
            if name in tied:
                continue
            raise KilnError(f"missing tensor in checkpoint: {name}")
        if tuple(ckpt.shapes[name]) != tuple(shape):
            raise KilnError(f"tensor {name} has shape {tuple(ckpt.shapes[name])}, expected {tuple(shape)}")
        weights[name] = ckpt.load(name).to(device=device, dtype=dtype)
    return weights


def eos_ids(config: dict, generation: dict) -> list[int]:
    """End-of-sequence ids named by generation_config (preferred) or config."""
    ids: list[int] = []
    for src in (generation.get("eos_token_id"), config.get("eos_token_id")):
        for i in ([src] if isinstance(src, int) else src or []):
            if i not in ids:
                ids.append(i)
    return ids


class Model:
    """A model family: `weight_shapes` declares the checkpoint, `forward` is calls to `ops`."""

    config_class: type

    def __init__(self, cfg, weights: dict[str, torch.Tensor], ops):
        self.cfg, self.w, self.ops = cfg, weights, ops

    @classmethod
    def weight_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def make_state(self, dtype, device) -> list:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, state: list, last_only: bool = True):
        raise NotImplementedError
