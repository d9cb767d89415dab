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
    # The dtype the model computes it in, where its scales are kept wider (GGUF's f16 scales as f32,
    # so that dequantising stays exact): dequantize works in the scales' dtype, then casts to this.
    out_dtype: torch.dtype | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 32 // self.bits)

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype or self.scales.dtype

    @property
    def nbytes(self) -> int:
        """The bytes it holds: the packed words, scales and biases."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def _with(self, packed, scales, biases) -> "QuantizedWeight":
        return QuantizedWeight(packed, scales, biases, self.bits, self.group_size, self.out_dtype)

    def to(self, device=None, dtype=None) -> "QuantizedWeight":
        """On `device`, its scales and biases in `dtype` (the packed words stay as they are)."""
        return self._with(self.packed.to(device), self.scales.to(device, dtype), self.biases.to(device, dtype))

    def split(self, sizes: list[int]) -> list["QuantizedWeight"]:
        """Row blocks of `sizes` rows (a packed projection's parts)."""
        parts = zip(self.packed.split(sizes), self.scales.split(sizes), self.biases.split(sizes))
        return [self._with(*p) for p in parts]

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The rows at `index` (an embedding lookup), or, of a stack [E, rows, cols], expert `index`."""
        return self._with(self.packed[index], self.scales[index], self.biases[index])

    __getitem__ = rows


def cat_rows(weights: list) -> "QuantizedWeight | torch.Tensor":
    """Weights stacked row-wise: tensors by torch.cat, quantized ones word by word (one format). Parts
    in different formats (a GGUF Q4_K_M file mixes types inside q|k|v and gate|up) are dequantised and
    stacked as one 16-bit weight: correct, without the memory saving for that projection."""
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    formats = {(w.bits, w.group_size, w.dtype, w.shape[-1]) for w in quantized}
    if len(quantized) < len(weights) or len(formats) > 1:
        weights = [dequantize(w) if isinstance(w, QuantizedWeight) else w for w in weights]
    if not isinstance(weights[0], QuantizedWeight):
        return torch.cat(weights, dim=-2 if weights[0].dim() >= 2 else 0)
    # rows are the second-last axis (of a 2-D weight and of an expert stack [E, rows, cols] alike)
    return weights[0]._with(*(torch.cat([getattr(w, f) for w in weights], dim=-2)
                              for f in ("packed", "scales", "biases")))


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values [..., K] in [0, 2^bits) -> the LSB-first bit stream of each row in 32-bit words."""
    k = q.shape[-1]
    flat = q.reshape(-1, k).to(torch.int64)
    pos = torch.arange(k, dtype=torch.int64, device=q.device) * bits            # each value's first bit
    words = torch.zeros(flat.shape[0], k * bits // 32 + 1, dtype=torch.int64, device=q.device)
    words.index_add_(1, pos // 32, flat << (pos % 32))                          # distinct bits: add = or
    spill = (pos % 32) + bits > 32                                              # values across a word boundary
    words.index_add_(1, pos[spill] // 32 + 1, flat[:, spill] >> (32 - pos[spill] % 32))
    words = words[:, :-1] & 0xFFFFFFFF
    return words.to(torch.int32).reshape(*q.shape[:-1], -1)   # the same 32 bits, as int32


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack: integer values [..., K] (int32 where bits divide 32, else int64)."""
    if 32 % bits == 0:      # whole values in each word: one shift per value, no gather (~20x faster on CPU)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        q = (packed.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)     # the mask drops the sign bits
        return q.reshape(*packed.shape[:-1], -1)
    words = packed.reshape(-1, packed.shape[-1]).to(torch.int64) & 0xFFFFFFFF
    k = packed.shape[-1] * 32 // bits
    pos = torch.arange(k, dtype=torch.int64, device=packed.device) * bits
    stream = torch.cat([words, torch.zeros_like(words[:, :1])], dim=1)          # a word past the end
    low = stream[:, pos // 32] >> (pos % 32)
    high = stream[:, pos // 32 + 1] << (32 - pos % 32)
    q = (low | torch.where((pos % 32) + bits > 32, high, torch.zeros_like(high))) & (2 ** bits - 1)
    return q.reshape(*packed.shape[:-1], k)


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


# -- mx.quantize (the reference: kiln/ops/quant/reference.py re-exports it beside mx.dequantize) ----

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
EPS = 1e-7      # the smallest scale mlx lets a group have (a constant group)


def check_format(bits: int, group_size: int) -> None:
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ValueError(f"affine quantisation takes bits in {BITS} and group sizes in {GROUP_SIZES}, "
                         f"got bits {bits}, group size {group_size}")


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> QuantizedWeight:
    """mx.quantize(w, group_size, bits): every step in f32 as mlx's CPU kernel takes it."""
    check_format(bits, group_size)
    if w.shape[-1] % group_size:
        raise ValueError(f"the last dimension ({w.shape[-1]}) is not a multiple of the group size {group_size}")
    groups = w.float().reshape(-1, group_size)                                   # [n, G]
    n_bins = float(2 ** bits - 1)
    w_max, w_min = groups.max(-1).values, groups.min(-1).values
    low_edge = w_min.abs() > w_max.abs()
    # a tensor divisor: torch on CUDA divides by a Python number as a product with its reciprocal,
    # one ulp off mlx's quotient now and then (the H200's synth draw differed from the CPU's)
    scale = torch.clamp((w_max - w_min) / torch.full_like(w_max, n_bins), min=EPS)
    scale = torch.where(low_edge, scale, -scale)
    edge = torch.where(low_edge, w_min, w_max)
    q0 = torch.round(edge / scale)
    exact = q0 != 0
    scale = torch.where(exact, edge / torch.where(exact, q0, 1.0), scale)
    bias = torch.where(exact, edge, torch.zeros_like(edge))
    q = torch.round((groups - bias[:, None]) / scale[:, None]).clamp(0, n_bins).to(torch.int64)
    rows = w.shape[:-1]
    packed = pack(q.reshape(*rows, w.shape[-1]), bits)
    cast = lambda t: t.to(w.dtype).reshape(*rows, -1)  # noqa: E731
    return QuantizedWeight(packed, cast(scale), cast(bias), bits, group_size)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """mx.dequantize: scale * q + bias in the scales' dtype, each step rounded to it."""
    q = unpack(w.packed, w.bits).to(w.scales.dtype)
    g = w.group_size
    q = q.reshape(*q.shape[:-1], -1, g)
    out = w.scales[..., None] * q + w.biases[..., None]
    return out.reshape(*w.shape).to(w.dtype)      # scales kept wider (GGUF's, exact): one rounding here
