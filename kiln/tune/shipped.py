"""Tuning choices shipped with kiln (kiln/tune/shipped/<gpu>_<dtype>.json), for the GPUs the team has
measured: a cold start on such a GPU compiles the chosen variant of each shape and checks it with
the correctness gate, without timing every candidate.

A shipped file is one GPU's choices merged over models: {key, entries}, entries keyed by the
workload's label (op and whole shape), each {variant, ms}. A choice is used only where what makes
it valid matches: the GPU's name, SM count and compute capability, the Triton version, the dtype,
the file format, and the hash of that op's kernel sources (an op whose kernels changed since is
tuned as before). Driver, CUDA and torch versions move timings a little, never correctness (the
gate checks each choice at load), so they do not invalidate a file. `tools/ship_tune.py` writes it
from a tune cache.
"""

from __future__ import annotations

from pathlib import Path

from .cache import _slug, changed_ops, key_changes, read, without_ops

ROOT = Path(__file__).parent / "shipped"
# Key fields a shipped choice does not depend on (the gate re-checks each choice at load).
IGNORED = ("driver", "cuda", "torch", "model", "sources")


KEY = ("format", "gpu", "sms", "capability", "triton", "dtype")     # what a shipped file's choices hold for


def differs(a: dict, b: dict) -> list[str]:
    """The KEY fields two keys disagree on."""
    return [k for k in KEY if a.get(k) != b.get(k)]


def path(key: dict, root: Path | None = None) -> Path:
    return (root or ROOT) / f"{_slug(key['gpu'])}_{key['dtype']}.json"


def lookup(key: dict, labels: set[str], root: Path | None = None) -> dict:
    """Shipped entries for `labels` valid under `key` (the tuner's key for this load); {} when no
    file ships for this GPU and dtype, or it is stale or unreadable."""
    p = path(key, root)
    if not labels or not p.exists():
        return {}
    try:
        data = read(p)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if key_changes(data["key"], key, ignore=IGNORED):
        return {}
    fresh = without_ops(data["entries"], changed_ops(data["key"]["sources"], key["sources"]))
    return {label: e for label, e in fresh.items() if label in labels}


def merge(files: list[dict], sources: dict[str, str]) -> dict:
    """One shipped file from tune cache files ({key, entries}) of one GPU and dtype: each op's entries
    whose kernels hash as `sources` (today's), the later file winning where two measured a shape;
    only {variant, ms} kept."""
    if not files:
        raise ValueError("no tune cache files to ship")
    key = {k: files[0]["key"].get(k) for k in KEY}
    entries: dict = {}
    for data in files:
        if differ := differs(data["key"], key):
            raise ValueError(f"tune caches of another {', '.join(differ)} ({data['key'].get('gpu')})")
        stale = changed_ops(data["key"].get("sources") or {}, sources)
        for label, e in without_ops(data["entries"], stale).items():
            entries[label] = {"variant": e["variant"], "ms": e.get("ms")}
    ops = {label.split(" ", 1)[0] for label in entries}
    key["sources"] = {op: sources[op] for op in sorted(ops)}
    return {"key": key, "entries": dict(sorted(entries.items()))}
