"""A weight kept quantised in MLX's affine format (kiln/ops/quant/reference.py has the arithmetic):
the container the readers fill, the loader moves and merges, and the ops compute with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import KilnError
from .checkpoint import Checkpoint


@dataclass
class QuantizedWeight:
    """A weight [rows, cols] as mlx stores it: `packed` [rows, cols * bits / 32] uint32 (held as
    int32: torch has no uint32 arithmetic), `scales` and `biases` [rows, cols / group_size]."""
    packed: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 32 // self.bits)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """The bytes it holds: the packed words, scales and biases."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def _with(self, packed, scales, biases) -> "QuantizedWeight":
        return QuantizedWeight(packed, scales, biases, self.bits, self.group_size)

    def to(self, device=None, dtype=None) -> "QuantizedWeight":
        """On `device`, its scales and biases in `dtype` (the packed words stay as they are)."""
        return self._with(self.packed.to(device), self.scales.to(device, dtype), self.biases.to(device, dtype))

    def split(self, sizes: list[int]) -> list["QuantizedWeight"]:
        """Row blocks of `sizes` rows (a packed projection's parts)."""
        parts = zip(self.packed.split(sizes), self.scales.split(sizes), self.biases.split(sizes))
        return [self._with(*p) for p in parts]

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The rows at `index` (an embedding lookup)."""
        return self._with(self.packed[index], self.scales[index], self.biases[index])


def cat_rows(weights: list) -> "QuantizedWeight | torch.Tensor":
    """Weights stacked row-wise: tensors by torch.cat, quantized ones word by word (one format)."""
    if not isinstance(weights[0], QuantizedWeight):
        return torch.cat(weights)
    if len({(w.bits, w.group_size, w.dtype, w.shape[-1]) for w in weights}) != 1:
        raise ValueError("quantized weights packed together must share bits, group size, dtype and width")
    return weights[0]._with(*(torch.cat([getattr(w, f) for w in weights]) for f in ("packed", "scales", "biases")))


def quantized_view(ckpt: Checkpoint) -> Checkpoint:
    """An mlx-lm quantised checkpoint as kiln reads it: each quantised module's `.weight` (uint32
    words), `.scales` and `.biases` become one QuantizedWeight under `.weight`, shaped as the
    unquantised weight. A module is quantised iff its `.scales` exist (as mlx-lm decides);
    config.json's `quantization` gives the bits and group size, per module where it says so."""
    bases = [n[: -len(".scales")] for n in ckpt.shapes if n.endswith(".scales")]
    if not bases:
        return ckpt
    quant = ckpt.config.get("quantization") or ckpt.config.get("quantization_config")
    if not isinstance(quant, dict):
        raise KilnError(f"{ckpt.path}: quantised tensors but no `quantization` in config.json")
    formats = {base: module_format(quant, base) for base in bases}
    hidden = {f"{b}.{part}" for b in formats for part in ("scales", "biases")}
    shapes = {n: s for n, s in ckpt.shapes.items() if n not in hidden}
    for base, (bits, _) in formats.items():
        *rows, words = ckpt.shapes[f"{base}.weight"]
        shapes[f"{base}.weight"] = (*rows, words * 32 // bits)

    def load(name: str):
        base = name[: -len(".weight")]
        if not name.endswith(".weight") or base not in formats:
            return ckpt.load(name)
        bits, group_size = formats[base]
        packed = ckpt.load(name).contiguous().view(torch.int32)      # the same 32 bits: torch computes on int32
        return QuantizedWeight(packed, ckpt.load(f"{base}.scales"), ckpt.load(f"{base}.biases"), bits, group_size)

    return dataclasses.replace(ckpt, shapes=shapes, loader=load, locator=None, located=None)


def module_format(quant: dict, base: str) -> tuple[int, int]:
    """(bits, group size) of the module at `base`: its own entry in `quantization` (mlx-lm writes one
    per module that differs, under the checkpoint's module path) or the defaults."""
    if quant.get("mode", "affine") != "affine":
        raise KilnError(f"quantisation mode {quant.get('mode')!r} is not supported (affine only)")
    own = next((quant[k] for k in module_paths(base) if isinstance(quant.get(k), dict)), {})
    bits, group_size = own.get("bits", quant.get("bits")), own.get("group_size", quant.get("group_size"))
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise KilnError(f"{base}: quantisation with bits {bits} and group size {group_size} is not supported")
    return bits, group_size


def module_paths(base: str) -> list[str]:
    """The names a module may have in the checkpoint's config: kiln's (HF's) and a multimodal
    wrapper's (mlx-community keeps Qwen3.5's text model under language_model.)."""
    inner = base[len("model."):] if base.startswith("model.") else base
    return [base, f"language_model.{base}", f"language_model.model.{inner}", f"model.language_model.{inner}"]
