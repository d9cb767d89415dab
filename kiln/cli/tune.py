"""`kiln tune MODEL`: compile and tune the kernels for a model's shapes, fill the cache, print the
table of choices (stdout); the [autotune] lines and the [kiln] summary go to stderr."""

from __future__ import annotations

import argparse

import torch

from ..errors import KilnError


def add_tune_flags(p: argparse.ArgumentParser) -> None:
    from ..cli import _positive_int

    # --retune and --tune OP=VARIANT come with kiln.cli.add_runtime_flags.
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop measuring after this long; the rest take each op's default (default 600)")
    p.add_argument("--m", type=_positive_int, action="append", default=None, metavar="ROWS",
                   help="token counts to tune for (repeatable; default: the prefill chunk 512 and decode 1)")
    p.add_argument("--ops", default=None, help="comma-separated ops to tune (default: gemm,rmsnorm,rmsnorm_gemm)")


def add_parser(sub) -> None:
    from ..cli import add_runtime_flags

    p = sub.add_parser("tune", help="compile and tune the kernels for a model's shapes; print the choices")
    add_runtime_flags(p)
    add_tune_flags(p)


def parse_pins(items: list[str]) -> dict[str, str]:
    from .registry import get_op

    pins = {}
    for item in items:
        op, sep, name = item.partition("=")
        if not sep or not op or not name:
            raise KilnError(f"--tune takes OP=VARIANT, got {item!r}")
        get_op(op)
        pins[op] = name
    return pins


def setup(a):
    """(device, dtype, workloads, tuner) from the flags shared by `kiln tune` and `kiln kernels`."""
    from ..api import pick_device, pick_dtype, resolve_model
    from ..backends.cuda.common import interpreting
    from ..weights import open_checkpoint
    from .registry import REGISTRY, _load_families, get_op
    from .tuner import Tuner
    from .workloads import DECODE_ROWS, OPS, PREFILL_CHUNK, config_workloads

    dev = pick_device(a.device)
    if dev.type != "cuda" and not interpreting():
        raise KilnError("kernels run on a CUDA GPU; on CPU set TRITON_INTERPRET=1 (slow; timings mean nothing)")
    dtype = pick_dtype(a.dtype, dev)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise KilnError(f"no kernels for dtype {dtype}")
    if a.ops:
        ops = tuple(o.strip() for o in a.ops.split(",") if o.strip())
        for op in ops:
            get_op(op)
    else:   # every registered family (KILN_KERNELS_OFF may leave some out)
        _load_families()
        ops = tuple(o for o in OPS if o in REGISTRY)
    ckpt = open_checkpoint(resolve_model(a.model, quiet=a.quiet))
    workloads = config_workloads(ckpt.config, tuple(a.m) if a.m else (PREFILL_CHUNK, DECODE_ROWS), ops)
    if not workloads:
        raise KilnError(f"this model runs none of the ops {', '.join(ops)}")
    tuner = Tuner(dev, dtype, retune=a.retune, pins=parse_pins(a.tune), budget_s=a.budget, quiet=a.quiet)
    return dev, dtype, workloads, tuner


def table(rows: list) -> str:
    lines = ["| op | shape | variant | ms | how |", "|---|---|---|---:|---|"]
    for label, name, ms, how in rows:
        op, shape = label.split(" ", 1)
        lines.append(f"| {op} | {shape} | {name} | {'-' if ms is None else f'{ms:.4f}'} | {how} |")
    return "\n".join(lines)


def main(a) -> int:
    if a.budget is not None and not a.budget > 0:
        raise KilnError(f"--budget must be a positive number of seconds, got {a.budget}")
    _, _, workloads, tuner = setup(a)
    _, report = tuner.tune(workloads)
    print(table(report.rows))
    return 0
