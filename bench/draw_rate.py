"""Values a second of the synthesized quantised draw (synth.quantized_draw) of one expert stack, the
stage that bounds a synth: model's weights load (issue 21's 397B draws ~4 * 10^11 values).

    PYTHONPATH=. python3 bench/draw_rate.py OUT.json [--shape 512,2048,4096] [--bits 4] [--repeat 2]
        [--generators]

--generators: instead, one CPU core's ns a value for NumPy's SFC64 (synth's generator before
2026-12-05) and Philox (since: a GPU draws its stream too), a block of 2^22 float32 values each."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from kiln.tools.benchutil import environment, now_iso
from kiln.weights import synth


def generators(repeat: int) -> dict:
    """ns a value of each bit generator's f32 fill on this thread (best of `repeat`)."""
    out, n = np.empty(synth.BLOCK, dtype=np.float32), synth.BLOCK
    ns = {}
    for name in ("SFC64", "Philox"):
        times = []
        for r in range(repeat + 1):         # the first: pages and caches warm
            gen = np.random.Generator(getattr(np.random, name)(r))
            t = time.perf_counter()
            gen.random(dtype=np.float32, out=out)
            times.append(time.perf_counter() - t)
        ns[name] = min(times[1:]) / n * 1e9
    return ns


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="512,2048,4096")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--generators", action="store_true")
    args = ap.parse_args()
    if args.generators:
        ns = generators(max(args.repeat, 5))
        result = {"ns_per_value": ns, "values": synth.BLOCK, "date": now_iso(), "command": " ".join(sys.argv),
                  **environment(torch.device("cpu"))}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(", ".join(f"{k} {v:.2f} ns a value" for k, v in ns.items()))
        return 0
    shape = tuple(int(s) for s in args.shape.split(","))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    drawn = synth.Synthesis(synth.synth_config("qwen3.5-397b-a17b"), {name: shape}, False, 0)
    runs = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        synth.quantized_draw(drawn, name, (args.bits, 64), torch.bfloat16)
        runs.append(time.perf_counter() - t)
    n = math.prod(shape)
    where = "philox kernel on the GPU" if torch.cuda.is_available() else f"{synth.WORKERS} CPU threads"
    result = {"shape": shape, "bits": args.bits, "drawn_by": where, "draw_batch": synth.DRAW_BATCH,
              "trips_ahead": synth.TRIPS_AHEAD, "seconds": runs, "g_values_s": [n / s / 1e9 for s in runs],
              "date": now_iso(), "command": " ".join(sys.argv),
              **environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{n / 1e9:.2f} G values: " + ", ".join(f"{s:.2f} s ({n / s / 1e9:.2f} G/s)" for s in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
