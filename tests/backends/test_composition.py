"""The backends are compositions of the op families (kiln/ops/<family>/): each family's cuda class
overrides only its own reference's ops, no two families define the same name (the mixins share one
namespace: a private helper of one family would silently replace another's), and the cuda backend
offers every op the reference does."""

from __future__ import annotations

import inspect

from kiln.backends.cuda import CudaOps
from kiln.backends.reference import ReferenceOps


def family(cls) -> str | None:
    parts = cls.__module__.split(".")
    return parts[2] if parts[:2] == ["kiln", "ops"] and len(parts) > 3 else None


def test_no_name_is_defined_by_two_families():
    owners: dict[str, set[str]] = {}
    for cls in CudaOps.__mro__:
        if family(cls) is not None:
            for name in vars(cls):
                if not name.startswith("__"):
                    owners.setdefault(name, set()).add(family(cls))
    shared = {name: fams for name, fams in owners.items() if len(fams) > 1}
    assert not shared, f"defined by more than one family: {shared}"


def test_the_cuda_backend_offers_every_reference_op():
    ops = lambda cls: {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}  # noqa: E731
    assert ops(ReferenceOps) <= ops(CudaOps)
    assert {"rmsnorm", "linear_split", "gated_mlp", "attention", "gated_deltanet", "moe_experts",
            "greedy_next"} <= ops(ReferenceOps)


def test_a_cuda_method_falls_back_to_its_own_familys_reference():
    """super() from a family's cuda class reaches that family's reference, whatever the order of the
    other families in CudaOps's bases."""
    for cls in CudaOps.__mro__:
        if family(cls) is None or not cls.__name__.endswith("Cuda"):
            continue
        ref = next(b for b in cls.__mro__[1:] if family(b) == family(cls) and b.__name__.endswith("Reference"))
        for name in vars(cls):
            if not name.startswith("_") and callable(vars(cls)[name]):
                later = CudaOps.__mro__[CudaOps.__mro__.index(cls) + 1:]
                assert next(c for c in later if name in vars(c)) is ref, (cls.__name__, name)
