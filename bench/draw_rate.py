"""Values a second of the synthesized quantised draw (synth.quantized_draw) of one expert stack, the
stage that bounds a synth: model's weights load (issue 21's 397B draws ~4 * 10^11 values).

    PYTHONPATH=. python3 bench/draw_rate.py OUT.json [--shape 512,2048,4096] [--bits 4] [--repeat 2]"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from kiln.tools.benchutil import environment, now_iso
from kiln.weights import synth


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="512,2048,4096")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
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
