"""The kernel registry: each op (kernel family) declares its variants, its trusted variant, how to
draw inputs for a shape, its full and partial blocks, and its outputs.

An op is an object with the methods of `Op` below; the kernel families (kiln/ops/<family>/) register
their ops here when they are imported, so this module imports none of them. Tests add candidates
to an op with `extra_variant` (e.g. a wrong one that must be rejected).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import KilnError


@dataclass(frozen=True)
class Variant:
    """One way to run an op: a name that spells its parameters, the parameters, and optionally its
    own launcher `run(inputs, outputs, plan)` (composite algorithms, tests' planted candidates)."""
    name: str
    params: tuple = ()
    run: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def p(self) -> dict:
        return dict(self.params)


def variant(name: str, run: Callable | None = None, **params) -> Variant:
    return Variant(name, tuple(sorted(params.items())), run)


class Op:
    """A kernel family. Shapes are frozen dataclasses with a `rows` field (the runtime dimension:
    tokens, or tokens x heads) and a `key` (the compile-time dimensions, `tl.constexpr` in the kernels)."""

    name: str = ""
    sources: tuple[str, ...] = ()   # files whose text is hashed into the tune cache key
    shape_type: type = tuple        # the frozen dataclass of its shapes (built from a model's KernelShape)

    @property
    def family(self) -> str:
        """The kiln.ops package its kernels live in (KILN_KERNELS_OFF names families)."""
        return type(self).__module__.split(".")[-2]

    def accepts(self, shape) -> bool:
        """Whether its kernels take this shape at all (what a model declares may not fit them)."""
        return True

    def shape_str(self, shape) -> str:
        raise NotImplementedError

    def with_rows(self, shape, rows: int):
        """The same shape with another runtime row count (the gate's partial block, runtime buckets)."""
        raise NotImplementedError

    def catalogue(self, shape, dev) -> list[Variant]:
        """Every variant that can run this shape on this device (what `--tune op=NAME` may pin)."""
        raise NotImplementedError

    def candidates(self, shape, dev) -> list[Variant]:
        """The variants worth measuring for this shape (a pruned catalogue)."""
        return self.catalogue(shape, dev)

    def trusted(self, shape, dev) -> Variant:
        """The simplest correct variant: the gate's oracle."""
        raise NotImplementedError

    def default(self, shape, dev) -> Variant:
        """The choice when nothing was measured (tuning is optional: a default always works)."""
        return self.trusted(shape, dev)

    def blocks(self, shape) -> tuple[int, int]:
        """Row counts of the gate's full block (every tile full) and partial block (ragged)."""
        full = max(128, -(-shape.rows // 128) * 128)
        partial = shape.rows if shape.rows % 16 else full - 61
        return full, partial

    def inputs(self, shape, dtype: torch.dtype, device, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Fresh random inputs (never zeros) for `shape`."""
        raise NotImplementedError

    def outputs(self, shape, inputs: dict) -> dict[str, torch.Tensor]:
        """The output tensors, allocated (the gate fills them with NaN before each run)."""
        raise NotImplementedError

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        raise NotImplementedError

    def run(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        """Run variant `v`: its own launcher if it has one, else the op's kernel."""
        if v.run is not None:
            v.run(inputs, outputs, plan)
        else:
            self.launch(v, inputs, outputs, plan)

    def compile(self, v: Variant, shape, dtype: torch.dtype, device) -> list:
        """Compile `v` for `shape` without running it; returns the compiled kernels ([] if none)."""
        return []

    def kernel_sources(self, v: Variant) -> list | str:
        """The Triton functions `v` launches, or a CUDA C kernel's source (for `kiln kernels --dump`)."""
        return []


REGISTRY: dict[str, Op] = {}
_EXTRA: dict[str, list[Variant]] = {}


def register(op: Op) -> Op:
    REGISTRY[op.name] = op
    return op


def get_op(name: str) -> Op:
    """A registered op by name (its family must have been imported: kiln.backends.cuda imports them all)."""
    if name not in REGISTRY:
        raise KilnError(f"unknown op {name!r} (known: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def try_unmeasured() -> bool:
    """KILN_TRY_UNMEASURED=1: offer the forms kept out of the GPU candidates until they have been run
    on a GPU (catalogue-only), to measure them (with --retune: cached choices are not re-measured)."""
    return os.environ.get("KILN_TRY_UNMEASURED", "0") not in ("", "0")


def candidates(op: Op, shape, dev) -> list[Variant]:
    """The op's candidates and any added ones, less those KILN_TUNE_SKIP names ("op=variant,..."):
    a variant that faults on some GPU or toolchain kills the process (an illegal address cannot be
    caught), so it must be kept from running at all."""
    skip = {x.strip() for x in os.environ.get("KILN_TUNE_SKIP", "").split(",") if x.strip()}
    return [v for v in op.candidates(shape, dev) + _EXTRA.get(op.name, []) if f"{op.name}={v.name}" not in skip]


def catalogue(op: Op, shape, dev) -> list[Variant]:
    return op.catalogue(shape, dev) + _EXTRA.get(op.name, [])


@contextlib.contextmanager
def extra_variant(op_name: str, v: Variant) -> Iterator[Variant]:
    """Add a candidate to an op for the duration of a `with` block (tests, experiments)."""
    _EXTRA.setdefault(op_name, []).append(v)
    try:
        yield v
    finally:
        _EXTRA[op_name].remove(v)
