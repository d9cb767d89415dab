"""A routing profile of equal counts for every routed expert of MODEL: the static policy's hot set
is then each layer's lowest ids (ties go to the lower id), the right pick when routing is uniform
(a synthesized model without skew), where any hot set hits as often as any other.

    PYTHONPATH=. python3 bench/uniform_profile.py MODEL OUT.json

e.g. the 397B with its hot experts resident and the rest in host memory (issue 21):
    kiln bench synth:qwen3.5-397b-a17b:bits=4:router=8 --expert-policy static --expert-profile OUT.json
        --expert-home host --gpu-memory 140
A skewed model's profile comes from a run instead (`kiln run ... --save-expert-profile FILE`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kiln.models import model_config
from kiln.weights import open_checkpoint
from kiln.weights.experts import STACKS, layer_prefix


def profile(model: str) -> dict:
    ckpt = open_checkpoint(model)
    cls, cfg = model_config(ckpt.config)
    shapes = cls.weight_shapes(cfg)
    stacks = [n for n in shapes if n.endswith(STACKS)]
    if not stacks:
        raise SystemExit(f"{model}: no routed experts")
    return {layer_prefix(n): {str(e): 1 for e in range(shapes[n][0])} for n in stacks}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    prof = profile(args[0])
    Path(args[1]).write_text(json.dumps(prof))
    print(f"{len(prof)} layers, {len(next(iter(prof.values())))} experts each", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
