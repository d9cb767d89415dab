"""What every model file shares: config from a dict, strict weight loading, the Model protocol."""

from __future__ import annotations

import dataclasses
import re
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


def load_strict(ckpt, expected: dict[str, tuple[int, ...]], dtype, device, tied: tuple[str, ...] = (),
                progress: bool = False):
    """Tensors for exactly the `expected` names: anything missing, extra or mis-shaped is an error.
    `tied` names may be absent (they alias another weight)."""
    import sys

    from tqdm import tqdm

    from ..weights.upload import Uploader, pinned_upload_on

    extra = sorted(set(ckpt.shapes) - set(expected))
    if extra:
        raise KilnError(f"unexpected tensor in checkpoint: {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    uploader = Uploader(device) if pinned_upload_on(device) else None
    weights = {}
    try:
        for name, shape in tqdm(expected.items(), desc="load", unit="tensor", disable=not progress, file=sys.stderr,
                                leave=False):
            if name not in ckpt.shapes:
                if name in tied:
                    continue
                raise KilnError(f"missing tensor in checkpoint: {name}")
            if tuple(ckpt.shapes[name]) != tuple(shape):
                raise KilnError(f"tensor {name} has shape {tuple(ckpt.shapes[name])}, expected {tuple(shape)}")
            weights[name] = _load_one(ckpt, name, dtype, device, uploader)
    finally:
        if uploader is not None:
            uploader.finish()
    return weights


def _load_one(ckpt, name: str, dtype, device, uploader):
    """One tensor on `device` in `dtype`: read from its file into pinned buffers where the checkpoint
    can say where its bytes lie, else through the reader (a view of the file's memory map)."""
    from ..weights.upload import file_reads_on

    if uploader is not None and file_reads_on() and (span := ckpt.locate(name)) is not None:
        return uploader.upload_span(span, dtype)
    stored = ckpt.load(name)
    if uploader is not None and stored.device.type == "cpu":
        return uploader.upload(stored, dtype)
    w = stored.to(device=device, dtype=dtype)    # to the GPU straight from the file's pages
    if w.data_ptr() == stored.data_ptr() and w.device.type == "cpu":
        w = w.clone()        # a read-only view of the file (same device and dtype): own a copy
    return w


def eos_ids(config: dict, generation: dict) -> list[int]:
    """End-of-sequence ids named by generation_config (preferred) or config."""
    ids: list[int] = []
    for src in (generation.get("eos_token_id"), config.get("eos_token_id")):
        for i in ([src] if isinstance(src, int) else src or []):
            if i not in ids:
                ids.append(i)
    return ids


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(ckpt):
    """Per-expert checkpoint names (`experts.{e}.gate_proj.weight`, ...) -> the fused layout the
    models use (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]).
    Fused checkpoints pass through unchanged."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in ckpt.shapes:
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
    if not groups:
        return ckpt
    shapes = {n: s for n, s in ckpt.shapes.items() if not _EXPERT.match(n)}
    parts: dict[str, list] = {}
    for prefix, experts in groups.items():
        count = max(experts) + 1
        for e in range(count):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if kind not in experts.get(e, {}):
                    raise KilnError(f"missing tensor in checkpoint: {prefix}.{e}.{kind}.weight")
        gate, down = ckpt.shapes[experts[0]["gate_proj"]], ckpt.shapes[experts[0]["down_proj"]]
        shapes[f"{prefix}.gate_up_proj"] = (count, 2 * gate[0], gate[1])
        shapes[f"{prefix}.down_proj"] = (count, *down)
        parts[f"{prefix}.gate_up_proj"] = [(experts[e]["gate_proj"], experts[e]["up_proj"]) for e in range(count)]
        parts[f"{prefix}.down_proj"] = [(experts[e]["down_proj"],) for e in range(count)]

    def load(name):
        if name not in parts:
            return ckpt.load(name)
        return torch.stack([torch.cat([ckpt.load(n) for n in names]) for names in parts[name]])

    def locate(name):
        return None if name in parts else ckpt.locate(name)

    return dataclasses.replace(ckpt, shapes=shapes, loader=load, locator=locate, located=load)


def decoder_layer_shapes(c, extra_attn: dict | None = None) -> dict[str, tuple[int, ...]]:
    """One dense decoder layer's attention and gated-MLP weights (names relative to the layer)."""
    h, d, f = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = {"self_attn.q_proj.weight": (c.num_attention_heads * d, h),
              "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
              "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
              "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return {**shapes, **(extra_attn or {})}


class Model:
    """A model family: `weight_shapes` declares the checkpoint, `forward` is calls to `ops`."""

    config_class: type

    def __init__(self, cfg, weights: dict[str, torch.Tensor], ops):
        self.cfg, self.w, self.ops = cfg, weights, ops

    @classmethod
    def weight_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @classmethod
    def tied_names(cls, cfg) -> tuple[str, ...]:
        """Names a checkpoint may omit because they alias another weight (a tied LM head)."""
        return ("lm_head.weight",) if getattr(cfg, "tie_word_embeddings", False) else ()

    @classmethod
    def sanitize(cls, ckpt):
        """Checkpoint quirks, mapped to the names `weight_shapes` declares (default: none)."""
        return ckpt

    def make_state(self, dtype, device) -> list:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, state: list, last_only: bool | int = True):
        """Logits of the last row (True), of the last n rows (an int n >= 1), or of every row (False):
        the LM head runs only for those rows."""
        raise NotImplementedError
