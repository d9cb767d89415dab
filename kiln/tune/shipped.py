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

A shipped file also holds `pruning`: per op, the variants measured on that GPU ("seen") and those
that came within PRUNE_WITHIN of a shape's best or were chosen ("near"). On any GPU of the same
compute capability, Triton version and dtype, a shape with no choice of its own (an unknown GPU, a
new model) does not measure the variants seen but never near (`never`): a cold tune measures fewer.
`--retune` measures every candidate. KILN_SHIPPED=0 leaves the choices out (pruning stays): what a
GPU without shipped choices does.
"""

from __future__ import annotations

import os
from pathlib import Path

from .cache import _slug, changed_ops, key_changes, read, without_ops

ROOT = Path(__file__).parent / "shipped"
# Key fields a shipped choice does not depend on (the gate re-checks each choice at load).
IGNORED = ("driver", "cuda", "torch", "model", "sources")


KEY = ("format", "gpu", "sms", "capability", "triton", "dtype")     # what a shipped file's choices hold for
CLASS = ("format", "capability", "triton", "dtype")     # what its pruning holds for (any GPU of the class)
PRUNE_WITHIN = 0.05     # a variant within 5% of a shape's best is kept: timings move a few % run to run


def differs(a: dict, b: dict) -> list[str]:
    """The KEY fields two keys disagree on."""
    return [k for k in KEY if a.get(k) != b.get(k)]


def path(key: dict, root: Path | None = None) -> Path:
    return (root or ROOT) / f"{_slug(key['gpu'])}_{key['dtype']}.json"


def lookup(key: dict, labels: set[str], root: Path | None = None) -> dict:
    """Shipped entries for `labels` valid under `key` (the tuner's key for this load); {} when no
    file ships for this GPU and dtype, or it is stale or unreadable."""
    p = path(key, root)
    if not labels or not p.exists() or os.environ.get("KILN_SHIPPED", "1") == "0":
        return {}
    try:
        data = read(p)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if key_changes(data["key"], key, ignore=IGNORED):
        return {}
    fresh = without_ops(data["entries"], changed_ops(data["key"]["sources"], key["sources"]))
    return {label: e for label, e in fresh.items() if label in labels}


def stale(sources: dict[str, str], root: Path | None = None) -> dict[str, list[str]]:
    """Per shipped file (its name), the ops whose shipped choices today's kernel sources retire: a cold
    start tunes those ops until they are measured and shipped again."""
    out = {}
    for p in sorted((root or ROOT).glob("*.json")):
        try:
            shipped_sources = read(p)["key"].get("sources") or {}
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        out[p.name] = [op for op in sorted(shipped_sources) if shipped_sources[op] != sources.get(op)]
    return out


def never(key: dict, root: Path | None = None) -> dict[str, set[str]]:
    """Per op, the variants no shipped file of this GPU class (CLASS fields of `key`) found worth
    measuring: seen on some GPU of the class, near a shape's best on none. Ops whose kernels hash
    otherwise than in `key` are left out (their variants are all measured)."""
    seen: dict[str, set[str]] = {}
    near: dict[str, set[str]] = {}
    for p in sorted((root or ROOT).glob(f"*_{key['dtype']}.json")):
        try:
            data = read(p)
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        k = data["key"]
        if any(k.get(f) != key.get(f) for f in CLASS):
            continue
        for op, pr in (data.get("pruning") or {}).items():
            if op in key["sources"] and (k.get("sources") or {}).get(op) == key["sources"][op]:
                seen.setdefault(op, set()).update(pr.get("seen", ()))
                near.setdefault(op, set()).update(pr.get("near", ()))
    return {op: names - near[op] for op, names in seen.items() if names - near[op]}


def measured_entries(entries: dict) -> dict:
    """The entries a tuner chose by measuring (or a shipped file's): not the defaults it only gated
    when its budget was spent."""
    return {label: e for label, e in entries.items() if not e.get("gated")}


def merge(files: list[dict], sources: dict[str, str]) -> dict:
    """One shipped file from tune cache files ({key, entries}) of one GPU and dtype: each op's entries
    whose kernels hash as `sources` (today's), the later file winning where two measured a shape;
    only {variant, ms} kept; and the pruning of every measured shape (and of an earlier shipped file)."""
    if not files:
        raise ValueError("no tune cache files to ship")
    key = {k: files[0]["key"].get(k) for k in KEY}
    entries: dict = {}
    for data in files:
        if differ := differs(data["key"], key):
            raise ValueError(f"tune caches of another {', '.join(differ)} ({data['key'].get('gpu')})")
        stale = changed_ops(data["key"].get("sources") or {}, sources)
        for label, e in measured_entries(without_ops(data["entries"], stale)).items():
            entries[label] = {"variant": e["variant"], "ms": e.get("ms")}
    prune = pruning(files, sources)
    ops = {label.split(" ", 1)[0] for label in entries} | set(prune)
    key["sources"] = {op: sources[op] for op in sorted(ops)}
    return {"key": key, "entries": dict(sorted(entries.items())), "pruning": prune}


def pruning(files: list[dict], sources: dict[str, str]) -> dict:
    """Per op {near, seen}: every variant measured, and those within PRUNE_WITHIN of a shape's best or
    chosen, over the files' fresh entries (an earlier shipped file's pruning carried over)."""
    seen: dict[str, set[str]] = {}
    near: dict[str, set[str]] = {}
    for data in files:
        stale = changed_ops(data["key"].get("sources") or {}, sources)
        for op, pr in (data.get("pruning") or {}).items():
            if op not in stale:
                seen.setdefault(op, set()).update(pr["seen"])
                near.setdefault(op, set()).update(pr["near"])
        for label, e in measured_entries(without_ops(data["entries"], stale)).items():
            op = label.split(" ", 1)[0]
            near.setdefault(op, set()).add(e["variant"])
            if measured := e.get("measured"):
                best = min(measured.values())
                seen.setdefault(op, set()).update(measured)
                near[op].update(v for v, ms in measured.items() if ms <= best * (1 + PRUNE_WITHIN))
    return {op: {"near": sorted(near[op]), "seen": sorted(seen.get(op, ()))} for op in sorted(near)}
