"""The cpu backend: the reference backend with quantised projections kept quantised, and attention
without the reference's GQA copies (kiln/ops/attention/cpu.py).

At load (`prepare`) each quantised projection shape is run through its forms on fresh random inputs:
the reference (dequantise, then F.linear: the trusted form), torch's int4 kernel (kiln/ops/quant/cpu.py)
and a 16-bit copy made once; a form is kept only if it lands within `GATE` of the trusted output
(relative to its scale; bf16 rounding is ~4e-3), then the fastest kept form of a shape is chosen,
separately for a decode step's rows and a prefill chunk's. Everything else is the reference's.
"""

from __future__ import annotations

import sys
import time

import torch

from ..ops.attention.cpu import AttentionCpu
from ..ops.quant import cpu as qcpu
from ..weights.quantized import QuantizedWeight, dequantize
from .reference import ReferenceOps

GATE = 2e-2          # max |y - trusted| / max |trusted|: a wrong layout or scale lands near 1
DECODE_ROWS = 1
PREFILL_ROWS = 64    # a prefill chunk's forms measured on 64 rows: 512 rows of a large LM head take seconds
REPEATS = 5


class CpuOps(AttentionCpu, ReferenceOps):
    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.choice: dict[tuple, str] = {}     # (rows bucket, shape key) -> form name
        self.copies: dict[tuple, object] = {}  # (id(weight), form) -> its int4 or 16-bit copy
        self.report: list[str] = []

    # -- load ---------------------------------------------------------------------------------------

    def prepare(self, model, dtype: torch.dtype, *, quiet: bool = True, **_):
        """Measure each quantised projection shape's forms; make the copies the choices need."""
        t0 = time.perf_counter()
        weights = [w for w in model.w.values() if isinstance(w, QuantizedWeight) and w.packed.dim() == 2]
        for w in weights:
            for rows in (DECODE_ROWS, PREFILL_ROWS):
                key = (_bucket(rows), _shape_key(w))
                if key not in self.choice:
                    self.choice[key] = self._measure(w, rows, dtype)
        for w in weights:
            names = {self.choice[(_bucket(r), _shape_key(w))] for r in (DECODE_ROWS, PREFILL_ROWS)}
            if "int4" in names:
                self.copies[(id(w), "int4")] = qcpu.to_int4(w)
            if "dense16" in names:
                self.copies[(id(w), "dense16")] = qcpu.dense16(w)
        if not quiet and weights:
            print(f"[kiln] cpu forms chosen in {time.perf_counter() - t0:.1f} s: " + "; ".join(self.report),
                  file=sys.stderr)

    def _measure(self, w: QuantizedWeight, rows: int, dtype: torch.dtype) -> str:
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = torch.nn.functional.linear(x.float(), dequantize(w).float())
        forms = {"reference": lambda: super(CpuOps, self).linear(x, w)}
        if qcpu.int4_fits(w):
            c4 = qcpu.to_int4(w)
            forms["int4"] = lambda: qcpu.int4_linear(x, c4)
        if rows == DECODE_ROWS:    # f16's product is fast for one row only
            c16 = qcpu.dense16(w)
            forms["dense16"] = lambda: qcpu.dense16_linear(x, c16)
        times = {}
        for name, run in forms.items():
            err = (run().float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            if name == "reference" or err <= GATE:
                times[name] = _time(run)
        best = min(times, key=times.get)
        self.report.append(f"{w.shape[0]}x{w.shape[1]} q{w.bits}g{w.group_size} rows {rows}: {best} "
                           + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()))
        return best

    # -- run ----------------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, QuantizedWeight) and b is None:
            form = self.choice.get((_bucket(x.numel() // x.shape[-1]), _shape_key(w)))
            copy = self.copies.get((id(w), form))
            if form == "int4" and copy is not None:
                return qcpu.int4_linear(x, copy)
            if form == "dense16" and copy is not None:
                return qcpu.dense16_linear(x, copy)
        return super().linear(x, w, b)

    def linear_split(self, x: torch.Tensor, w, sizes: list[int]) -> list:
        """A packed weight's projections: one product on its kept form, its output split (the
        reference runs each part, which would dequantise each part's slice on every call)."""
        if isinstance(w, QuantizedWeight) and self.choice.get((_bucket(x.numel() // x.shape[-1]), _shape_key(w))) \
                in ("int4", "dense16"):
            return list(self.linear(x, w).split(sizes, dim=-1))
        return super().linear_split(x, w, sizes)


def _bucket(rows: int) -> str:
    return "decode" if rows <= 4 else "prefill"


def _shape_key(w: QuantizedWeight) -> tuple:
    return (tuple(w.shape), w.bits, w.group_size, w.scales.dtype)


def _time(run) -> float:
    run()
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best
