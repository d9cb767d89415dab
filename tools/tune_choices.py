"""The tuner's decode-step choices in tune cache files: each one-row workload's pick, fused or not, and its time.

For a fusion op the best unfused time (or the best fused one) is printed beside the pick.

    python3 tools/tune_choices.py $KILN_CACHE_DIR/tune/nvidia-h200_<signature>_bf16.json [...]

Fusion ops: rmsnorm_gemm (norm in the GEMV's prologue or not), gemm_act (activation in the gate_up
epilogue), act_gemm (the activation in the down GEMV's prologue), gdn_decode (the whole step in one
kernel, BV = dv: the gated norm inside); the others list their pick only.
"""

from __future__ import annotations

import json
import sys


def decode_rows(entries: dict):
    for key, c in sorted(entries.items()):
        op, shape = key.split(" ", 1)
        if shape.startswith(("1x", "1_")) or op == "attention_decode":
            yield op, shape, c


def describe(op: str, c: dict) -> str:
    m, pick = c.get("measured", {}), c.get("variant")
    unfused = {k: v for k, v in m.items() if k.startswith("unfused") and not k.endswith("trusted")}
    if c.get("gated"):           # a default taken when the budget was spent
        return f"{pick} (gated, not timed)"
    ms = c.get("ms")
    line = f"{pick} {'-' if ms is None else f'{ms * 1e3:.2f}'} us"
    if unfused and pick not in unfused:
        line += f" (fused; best unfused {min(unfused.values()) * 1e3:.2f} us)"
    elif unfused:
        best_fused = min((v for k, v in m.items() if not k.startswith("unfused")), default=None)
        line += " (unfused" + (f"; best fused {best_fused * 1e3:.2f} us)" if best_fused else ")")
    return line


def main(paths: list[str]) -> None:
    for path in paths:
        d = json.load(open(path))
        print(f"# {path} ({d['key'].get('gpu')}, {d['key'].get('dtype')})")
        for op, shape, c in decode_rows(d["entries"]):
            print(f"  {op:16s} {shape:28s} {describe(op, c)}")


if __name__ == "__main__":
    main(sys.argv[1:])
