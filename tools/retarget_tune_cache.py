"""Rewrite the kernel-source hashes in tune cache files to the current sources, keeping every choice:
an A/B of a change that moves or renames kernel files without changing what they compute then runs
the same variants on both sides (the tuner's own noise is left out of the comparison).

Usage: python tools/retarget_tune_cache.py CACHE_DIR/tune/*.json
Each file's ops must still exist and their chosen variants must still be in the catalogue (checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kiln.backends.cuda  # noqa: F401  (the kernel families register their ops)
from kiln.fsutil import write_atomic
from kiln.tune.cache import sources_hash
from kiln.tune.registry import REGISTRY


def retarget(path: Path) -> int:
    data = json.loads(path.read_text())
    ops = sorted({label.split(" ", 1)[0] for label in data["entries"]} | set(data["key"]["sources"]))
    missing = [op for op in ops if op not in REGISTRY]
    if missing:
        raise SystemExit(f"{path}: ops no longer registered: {missing}")
    data["key"]["sources"] = sources_hash([REGISTRY[op] for op in ops])
    raw = json.dumps(data, indent=1, sort_keys=True).encode()
    write_atomic(path, lambda f: f.write(raw))
    return len(data["entries"])


def main(paths: list[str]) -> int:
    for p in paths:
        print(f"{p}: {retarget(Path(p))} choices kept, sources rehashed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
