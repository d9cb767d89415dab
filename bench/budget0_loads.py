"""What a load that measures nothing (KILN_TUNE_BUDGET_S=0, as the CPU tests load) costs under the
Triton interpreter, first and again, in a fresh tune cache: the first gates each op's default against
its trusted variant; since a914ba7 the cache keeps those gated defaults, so the next load reuses them.

    TRITON_INTERPRET=1 python3 bench/budget0_loads.py OUT.json [--model synth:tiny-qwen3.5-moe-p2] [--loads 2]
JSON to OUT, one line a load on stdout."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="synth:tiny-qwen3.5-moe-p2")
    p.add_argument("--loads", type=int, default=2)
    a = p.parse_args()
    os.environ["KILN_TUNE_BUDGET_S"] = "0"
    import kiln
    from kiln.tools.benchutil import environment, now_iso

    rows = []
    with tempfile.TemporaryDirectory() as root:
        os.environ["KILN_CACHE_DIR"] = root         # an empty kiln cache (tune cache included)
        for i in range(a.loads):
            t0 = time.perf_counter()
            kiln.load(a.model, device="cpu", dtype="f32", backend="cuda")
            rows.append({"load": i + 1, "seconds": round(time.perf_counter() - t0, 3)})
            print(f"load {i + 1}: {rows[-1]['seconds']:.2f} s", flush=True)
    out = {"bench": "budget0_loads", "model": a.model, "date": now_iso(), **environment(torch.device("cpu")),
           "command": shlex.join(["python3", *sys.argv]), "loads": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
