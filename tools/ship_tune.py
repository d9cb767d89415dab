"""Ship tuning choices with kiln: merge tune cache files of one GPU (a machine's $KILN_CACHE_DIR/tune,
or a `gpu_run.sh tunecache` archive unpacked) into kiln/tune/shipped/<gpu>_<dtype>.json, keeping each
op's choices only where its kernel sources hash as they do now (kiln/tune/shipped.py), and the pruning
of every measured shape (variants within 5% of a best, of all measured: kept per op in the file).

    python3 tools/ship_tune.py DIR [DIR ...]     # every *_<dtype>.json tune file under the DIRs
    python3 tools/ship_tune.py --stale           # which ops' shipped choices today's sources retire
    python3 tools/ship_tune.py --cover FILE MODEL [MODEL ...]   # per op, how many of the shapes a load of
                                                 # MODEL tunes on a GPU FILE ships a current choice for

An existing shipped file of the same GPU and dtype is merged first, so choices measured for other
models stay; a later file wins where two measured one shape. Prints what each file holds.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import kiln.backends.cuda  # noqa: F401  (registers every op)
from kiln.fsutil import write_atomic
from kiln.tune import shipped
from kiln.tune.cache import changed_ops, read, sources_hash
from kiln.tune.registry import REGISTRY


def main(dirs: list[str]) -> None:
    sources = sources_hash(REGISTRY.values())
    groups = defaultdict(list)
    for d in dirs:
        for p in sorted(Path(d).rglob("*.json")):
            try:
                data = read(p)
            except (OSError, ValueError) as e:
                print(f"skipped {p}: {e}", file=sys.stderr)
                continue
            groups[shipped.path(data["key"])].append(data)
    for target, files in groups.items():
        if target.exists():      # kept unless made under another Triton (or format): then replaced
            old = read(target)
            if differ := shipped.differs(old["key"], files[-1]["key"]):
                print(f"{target}: replacing choices made under another {', '.join(differ)}", file=sys.stderr)
            else:
                files.insert(0, old)
        made = shipped.merge(files, sources)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(made, indent=1, sort_keys=True).encode()
        write_atomic(target, lambda f: f.write(text))
        os.chmod(target, 0o644)     # package data: readable by everyone (the temporary file was 0600)
        ops = sorted({label.split(" ", 1)[0] for label in made["entries"]})
        print(f"{target}: {len(made['entries'])} choices ({', '.join(ops)}) from {len(files)} files")


def show_stale() -> None:
    for name, ops in shipped.stale(sources_hash(REGISTRY.values())).items():
        print(f"{name}: " + (f"retired: {', '.join(ops)} (tuned at a cold start until shipped again)" if ops
                             else "every op's choices current"))


def cover(entries: dict, retired: set[str], labels: list[str]) -> dict[str, tuple[int, int]]:
    """Per op: (shapes with a current shipped choice, shapes) among `labels`."""
    out: dict[str, list[int]] = {}
    for label in labels:
        op = label.split(" ", 1)[0]
        n = out.setdefault(op, [0, 0])
        n[0] += label in entries and op not in retired
        n[1] += 1
    return {op: (have, need) for op, (have, need) in out.items()}


def show_cover(file: str, models: list[str]) -> None:
    from kiln.api import resolve_model
    from kiln.backends.cuda import load_workloads
    from kiln.models import model_config
    from kiln.weights import open_checkpoint

    data = read(Path(file))
    retired = set(changed_ops(data["key"].get("sources") or {}, sources_hash(REGISTRY.values())))  # as lookup
    for model in models:
        cls, cfg = model_config(open_checkpoint(resolve_model(model, quiet=True)).config)
        got = cover(data["entries"], retired, [w.label for w in load_workloads(cls, cfg)])
        print(f"{model}: " + ", ".join(f"{op} {have}/{need}" + (" (retired)" if op in retired else "")
                                       for op, (have, need) in got.items()))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1:] == ["--stale"]:
        show_stale()
    elif sys.argv[1] == "--cover" and len(sys.argv) > 3:
        show_cover(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])
