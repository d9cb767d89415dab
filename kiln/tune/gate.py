"""The correctness gate: every candidate runs once on a full and on a partial block against the
trusted variant, its outputs poisoned with NaN first. It is rejected if any output stays NaN
(unwritten, or computed as NaN) or its max abs error exceeds max|trusted| / 64. Rejected
candidates are never timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import KilnError
from .registry import Op, Variant

TOLERANCE = 1 / 64


@dataclass
class Case:
    """One block: its shape, fresh random inputs, and the trusted variant's outputs on them."""
    shape: object
    inputs: dict
    expected: dict


@dataclass
class Verdict:
    ok: bool
    err: float        # the worst block's max abs error (nan: an output left unwritten or NaN)
    scale: float      # that block's max |trusted|
    reason: str = ""  # why it could not run at all, if it could not


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def poisoned(op: Op, shape, inputs: dict) -> dict:
    out = op.outputs(shape, inputs)
    for t in out.values():
        t.fill_(float("nan"))
    return out


def trusted_cases(op: Op, shape, trusted: Variant, dtype, device, gen: torch.Generator, plan=None) -> list[Case]:
    """The full and the partial block, each with the trusted variant's outputs."""
    cases = []
    for rows in op.blocks(shape):
        block = op.with_rows(shape, rows)
        inputs = op.inputs(block, dtype, device, gen)
        out = poisoned(op, block, inputs)
        op.run(trusted, inputs, out, plan)
        sync(device)
        for name, t in out.items():
            if torch.isnan(t).any():
                raise RuntimeError(f"trusted variant {trusted.name} of {op.name} {op.shape_str(block)} "
                                   f"left output {name} unwritten or NaN")
        cases.append(Case(block, inputs, out))
    return cases


def check(op: Op, v: Variant, cases: list[Case], plan=None) -> Verdict:
    worst = Verdict(True, 0.0, 0.0)
    for case in cases:
        out = poisoned(op, case.shape, case.inputs)
        try:
            op.run(v, case.inputs, out, plan)
            sync(next(iter(out.values())).device)
        except Exception as e:  # out of resources, a launch error: this variant cannot run here
            if (err := fault_error(e, op.name, v.name)) is not None:
                raise err from e        # a device fault: the context is lost, nothing else can run
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
            return Verdict(False, math.nan, 0.0, f"{type(e).__name__}: {first}".rstrip(": "))
        for name, ref in case.expected.items():
            got, ref = out[name].float(), ref.float()
            scale = ref.abs().max().item()
            err = math.nan if torch.isnan(got).any() else (got - ref).abs().max().item()
            if math.isnan(err) or err > scale * TOLERANCE:
                return Verdict(False, err, scale)
            if err > worst.err:
                worst = Verdict(True, err, scale)
    return worst


def fault_error(e: Exception, op: str, variant: str) -> KilnError | None:
    """The error to stop with when e is a device fault (illegal address, misaligned access, ...):
    unlike a build error it poisons the CUDA context, so nothing after it can run in this process."""
    text = str(e).lower()
    if not (type(e).__name__ == "AcceleratorError" or "illegal memory access" in text or "misaligned address" in text):
        return None
    return KilnError(f"{op}={variant} faulted on this GPU ({str(e).strip().splitlines()[0][:80]}); the CUDA context "
                     f"is lost: run again with KILN_TUNE_SKIP={op}={variant}")
