"""Ship tuning choices with kiln: merge tune cache files of one GPU (a machine's $KILN_CACHE_DIR/tune,
or a `gpu_run.sh tunecache` archive unpacked) into kiln/tune/shipped/<gpu>_<dtype>.json, keeping each
op's choices only where its kernel sources hash as they do now (kiln/tune/shipped.py), and the pruning
of every measured shape (variants within 5% of a best, of all measured: kept per op in the file).

    python3 tools/ship_tune.py DIR [DIR ...]     # every *_<dtype>.json tune file under the DIRs
    python3 tools/ship_tune.py --stale           # which ops' shipped choices today's sources retire

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
from kiln.tune.cache import read, sources_hash
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


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1:] == ["--stale"]:
        show_stale()
    else:
        main(sys.argv[1:])
