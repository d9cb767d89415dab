"""The cpu backend: the reference backend with quantised projections kept quantised, and attention
without the reference's GQA copies (kiln/ops/attention/cpu.py).

At load (`prepare`) each projection shape is run through its forms on fresh random inputs: the
reference (dequantise, then F.linear: the trusted form), torch's int4 kernel (kiln/ops/quant/cpu.py),
a GEMV compiled at load for decode rows (kiln/ops/quant/cgemv.py: exact values as bytes, f32 sums),
and 16-bit copies made once (f16 for a decode step's single row, bf16 for a prefill chunk's rows:
the fast products of each on our CI CPU); a form is kept only if it lands within `GATE` of the
trusted output (relative to its scale; bf16 rounding is ~4e-3), then the fastest kept form of a shape
is chosen, separately for a decode step's rows and a prefill chunk's. The bf16 copy is offered only
where int4 is not (Q5_0, Q8_0, plain f32): it rounds every weight to bf16 on top of x, and on a
SmolLM2 chat prompt whose top two logits are 0.08 apart at 25 (a bf16 near-tie) that flipped the
answer, where int4 (the values exact, only x and the scales rounded) did not. Plain (already dequantised)
f32 projections, such as GGUF K-quant tensors, get the 16-bit forms too. Copies stay inside
`COPY_BUDGET`. Everything else is the reference's.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..fsutil import cache_dir, write_atomic
from ..ops.attention.cpu import AttentionCpu
from ..ops.norm.cpu import NormCpu
from ..ops.quant import cgemv
from ..ops.quant import cpu as qcpu
from ..weights.quantized import QuantizedWeight, dequantize
from .reference import ReferenceOps

GATE = 2e-2          # max |y - trusted| / max |trusted|: a wrong layout or scale lands near 1
DECODE_ROWS = 1
PREFILL_ROWS = 64    # a prefill chunk's forms measured on 64 rows: 512 rows of a large LM head take seconds
BATCH_ROWS = 16      # rows that still run the decode forms (a batched decode step; a prompt this short)
REPEATS = 3
QUICK_S = 0.02       # a form slower than this once is timed once: the LM head's reference takes seconds
FORMAT = 3           # of the cached choices: bump when a form's meaning changes or one is added
COPY_BUDGET = 2 << 30        # bytes of 16-bit copies the forms may add
PREFILL_COPY_MAX = 1 << 24   # elements: a larger weight (an LM head) sees one row a prefill, and its
#                              logits rounded to bf16 would tie (SmolLM2's 49152 x 576 stays out)


class CpuOps(AttentionCpu, NormCpu, ReferenceOps):
    name = "cpu"
    head_major_kv = True     # each KV head's keys contiguous: attention reads them in one sweep
    static_windows = True    # sliding windows sliced from a plain cache, not a ring copied every step

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.choice: dict[tuple, str] = {}     # (rows bucket, shape key) -> form name
        self.copies: dict[tuple, object] = {}  # (id(weight), form) -> its int4 or 16-bit copy
        self.plan: dict[tuple, tuple] = {}     # (id(weight), rows bucket) -> (form, copy, run): the run's lookup
        self.report: list[str] = []
        self.made: dict[tuple, object] = {}    # copies made to measure a form, until the plan takes them
        self.head = 0                          # id of the model's LM head: no bf16 form (its logits would tie)

    # -- load ---------------------------------------------------------------------------------------

    def prepare(self, model, dtype: torch.dtype, *, quiet: bool = True, **_):
        """Measure each projection shape's forms; make the copies the choices need."""
        t0 = time.perf_counter()
        self.head = id(getattr(model, "lm_head", None))
        weights = _projections(model.w, dtype)
        path = _cache_path(dtype)
        cached = _read_choices(path)
        for w in weights:
            for rows in (DECODE_ROWS, PREFILL_ROWS):
                key = (_bucket(rows), _shape_key(w))
                if key not in self.choice:
                    name = cached.get(repr(key))       # a cached choice this weight cannot take is measured
                    self.choice[key] = name if name in self._names(w, rows) else self._measure(w, rows, dtype)
        fresh = {repr(k): v for k, v in self.choice.items()}
        if weights and any(cached.get(k) != v for k, v in fresh.items()):
            _write_choices(path, {**cached, **fresh})
        budget = COPY_BUDGET
        for w in weights:
            for rows in (DECODE_ROWS, PREFILL_ROWS):
                form = self.choice[(_bucket(rows), _shape_key(w))]
                if form != "reference" and (id(w), form) not in self.copies:
                    size = _copy_bytes(w, form)
                    if size > budget:
                        continue
                    budget -= size
                    made = self.made.get((id(w), form))
                    self.copies[(id(w), form)] = made if made is not None else _make(form, w)
                if self.copies.get((id(w), form)) is not None:
                    self.plan[(id(w), _bucket(rows))] = (form, self.copies[(id(w), form)], _run(form))
        self.made.clear()      # the copies no choice took
        if not quiet and weights:
            print(f"[kiln] cpu forms chosen in {time.perf_counter() - t0:.1f} s: " + "; ".join(self.report),
                  file=sys.stderr)

    def _measure(self, w, rows: int, dtype: torch.dtype) -> str:
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        forms = self._forms(w, x, rows)
        if len(forms) == 1:
            return "reference"
        want, times = None, {}
        for name, run in forms.items():
            t = time.perf_counter()
            y = run()
            first = time.perf_counter() - t
            if want is None:    # the reference runs first; in f32 its output is the f32 product itself
                dense = dequantize(w) if isinstance(w, QuantizedWeight) else w
                want = y.float() if dtype == torch.float32 else torch.nn.functional.linear(x.float(), dense.float())
            err = (y.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            if name == "reference" or err <= GATE:
                times[name] = first if first > QUICK_S or first > 4 * min(times.values(), default=first) \
                    else _time(run)
        best = min(times, key=times.get)
        for name in forms:     # keep only the winner's copy (the plan takes it): the rest may be large
            if name != best:
                self.made.pop((id(w), name), None)
        kind = f"q{w.bits}g{w.group_size}" if isinstance(w, QuantizedWeight) else str(w.dtype).replace("torch.", "")
        self.report.append(f"{w.shape[0]}x{w.shape[1]} {kind} rows {rows}: {best} "
                           + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()))
        return best

    def _names(self, w, rows: int) -> list[str]:
        """The forms that may run w at `rows` rows."""
        names = ["reference"] + (["int4"] if qcpu.int4_fits(w) else [])
        if rows == DECODE_ROWS:    # f16's product is fast for one row only, as is the C GEMV
            names += ["dense16"] + (["cgemv"] if cgemv.fits(w) else [])
        elif "int4" not in names and id(w) != self.head and w.shape[0] * w.shape[1] <= PREFILL_COPY_MAX:
            names.append("bf16")   # bf16's for many rows
        return names

    def _forms(self, w, x: torch.Tensor, rows: int) -> dict:
        """The forms that may run w at `rows` rows, each made ready to run on x."""
        forms = {"reference": lambda: super(CpuOps, self).linear(x, w)}
        for name in self._names(w, rows)[1:]:
            if (id(w), name) not in self.made:     # made once: the decode and prefill rows share it
                self.made[(id(w), name)] = _make(name, w)
            if self.made[(id(w), name)] is not None:
                forms[name] = _ready(_run(name), x, self.made[(id(w), name)])
        return forms

    @property
    def compute_dtype(self) -> str | None:
        """The coarsest precision the chosen forms compute a product in ("bf16": int4 and bf16 round
        x, and the int4 scales, to bf16; "f16": the f16 copies), None when every product runs at
        the model's dtype. `kiln compare` judges near-ties at this precision."""
        forms = {form for form, *_ in self.plan.values()} - {"cgemv"}     # f32 arithmetic on exact values
        return "bf16" if forms & {"int4", "bf16"} else "f16" if forms else None

    # -- run ----------------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        chosen = self.plan.get((id(w), _bucket(rows))) if b is None else None
        if chosen is None:
            return super().linear(x, w, b)
        form, copy, run = chosen
        if self.rows_apart and rows > 1 and form != "cgemv":    # cgemv sums each row alone by construction
            x2 = x.reshape(rows, x.shape[-1])
            return torch.cat([run(x2[i:i + 1], copy) for i in range(rows)]).view(*x.shape[:-1], -1)
        return run(x, copy)

    def linear_split(self, x: torch.Tensor, w, sizes: list[int]) -> list:
        """A packed weight's projections: one product on its kept form, its output split (the
        reference runs each part, which would dequantise each part's slice on every call)."""
        if (id(w), _bucket(x.numel() // x.shape[-1])) in self.plan:
            return list(self.linear(x, w).split(sizes, dim=-1))
        return super().linear_split(x, w, sizes)


_MAKE = {"int4": qcpu.to_int4, "dense16": qcpu.dense16, "bf16": qcpu.dense_bf16, "cgemv": cgemv.to_c}


def _cache_path(dtype: torch.dtype) -> Path:
    """The choices of this CPU, torch and thread count (what the timings depend on), as the cuda
    backend's tune cache keeps its own: measured once, read at every later load."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    key = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}|{dtype}|{FORMAT}"
    return cache_dir() / "tune" / f"cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_choices(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}     # none yet, or unreadable: measure again


def _write_choices(path: Path, choices: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(json.dumps(choices, indent=1, sort_keys=True).encode()))
    except OSError:
        pass          # a read-only cache: the choices are measured again next time
_RUN = {"int4": (qcpu, "int4_linear"), "dense16": (qcpu, "dense16_linear"), "bf16": (qcpu, "bf16_linear"),
        "cgemv": (cgemv, "c_linear")}


def _make(form: str, w):
    """A form's copy of w, or None where a compiled kernel failed to build (the form then runs nowhere)."""
    try:
        return _MAKE[form](w)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[kiln] cpu form {form} unavailable: {e}", file=sys.stderr)
        return None


def _run(form: str):
    """The function that runs a form's copy (looked up when used, so a test can replace it)."""
    return getattr(*_RUN[form])


def _ready(run, x, copy):
    return lambda: run(x, copy)


def _projections(weights: dict, dtype: torch.dtype) -> list:
    """The 2-D weights the model runs through `linear`: every quantised one, and plain f32
    projections (a 16-bit copy halves what a decode step reads)."""
    out, seen = [], set()
    for name, w in weights.items():
        plain = (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 == dtype
                 and name.endswith(("proj.weight", "lm_head.weight")))
        if (isinstance(w, QuantizedWeight) and w.packed.dim() == 2 or plain) and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def _copy_bytes(w, form: str) -> int:
    n = w.shape[0] * w.shape[1]
    return n // 2 if form == "int4" else n if form == "cgemv" else 2 * n


def _bucket(rows: int) -> str:
    """A decode step's rows (up to BATCH_ROWS requests decoded together run the single-row forms,
    whose arithmetic is row by row: each request gets the tokens it gets alone) or a prefill chunk's."""
    return "decode" if rows <= BATCH_ROWS else "prefill"


def _shape_key(w) -> tuple:
    if isinstance(w, QuantizedWeight):
        return (tuple(w.shape), w.bits, w.group_size, w.scales.dtype)
    return (tuple(w.shape), w.dtype)


def _time(run) -> float:
    run()
    best = float("inf")
    for _ in range(REPEATS):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best
