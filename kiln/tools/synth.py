"""`kiln synth ARCH OUT`: write an HF folder with seeded random weights for a named configuration
(kiln.weights.synth draws them; the tensors are the ones kiln's model for the config declares)."""

from __future__ import annotations

import math
import sys
import time

from ..cli.flags import nonneg_int, positive_float, positive_int
from ..errors import KilnError
from ..models import checkpoint_shapes, synthesis
from ..weights.synth import CONFIGS, DTYPES, MAX_SKEW, write_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("synth", help="write an HF folder with seeded random weights for a named configuration")
    p.add_argument("arch", nargs="?", help="configuration name (--list shows them)")
    p.add_argument("out", nargs="?", help="output folder (must not exist)")
    p.add_argument("--layers", type=positive_int, default=None, help="keep only the first N layers")
    p.add_argument("--seed", type=nonneg_int, default=0, help="weights seed (default 0)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="MoE routing skew: router rows scaled by rank^-SKEW (0, default: near-uniform routing)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="stored dtype (default bf16)")
    p.add_argument("--shard-mb", type=positive_float, default=4096, help="max safetensors shard size (MiB)")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(main=main)


def describe(name: str) -> str:
    c = CONFIGS[name]
    moe = f", {c['num_experts']} experts top-{c.get('num_experts_per_tok') or c.get('top_k_experts')}" \
        if c.get("num_experts") else ""
    try:
        n = sum(math.prod(s) for s in checkpoint_shapes(c).values())
        params = f"{n / 1e9:.2f}B params" if n >= 1e8 else f"{n / 1e6:.2f}M params"
    except KilnError:
        params = f"({c['model_type']} not supported by this kiln yet)"
    return (f"{name:20} {c['model_type']:17} hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
            f"vocab {c['vocab_size']}{moe}; {params}")


def main(a) -> int:
    if a.list:
        print("\n".join(describe(n) for n in CONFIGS))
        return 0
    if not a.arch or not a.out:
        raise KilnError("usage: kiln synth ARCH OUT [--layers N] [--seed S] [--dtype bf16|f32] (--list for ARCH)")
    t0 = time.perf_counter()
    if not 0.0 <= a.skew <= MAX_SKEW:
        raise KilnError(f"--skew takes 0 to {MAX_SKEW:g}, got {a.skew:g}")
    drawn = synthesis(a.arch, a.layers, a.seed, a.skew)
    out = write_checkpoint(drawn, a.out, a.arch, a.dtype, int(a.shard_mb * (1 << 20)), a.quiet)
    if not a.quiet:
        print(f"kiln: wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(out)
    return 0
