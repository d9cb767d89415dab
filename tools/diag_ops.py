"""Which op makes the cuda backend differ from the reference: the worst relative error per op on the same inputs.

Every stateless op call of a prefill (and 3 eager decode steps) on the cuda backend is also run by
the reference backend on clones of its inputs.

    python tools/diag_ops.py synth:qwen3.5-35b-a3b:layers=4 512 [OUT.json]      (GPU; on CPU under TRITON_INTERPRET=1)

The reference runs on clones of the inputs, so the cuda backend's own flow is untouched; ops that
keep state (attention's cache, the GDN state) are compared through their outputs' effect downstream.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch

STATELESS = ("linear", "linear_split", "gated_mlp", "add_rmsnorm_linear_split", "add_rmsnorm_gated_mlp", "act_mul",
             "rmsnorm", "add_rmsnorm", "rmsnorm_linear", "router_topk", "shared_gate_add", "moe_experts_gated",
             "moe_experts", "logits")


def flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)] if isinstance(out, (list, tuple)) else []


def clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, (list, tuple)):
        return type(a)(clone(x) for x in a)
    if isinstance(a, dict):
        return {k: clone(v) for k, v in a.items()}
    return a


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not got.is_floating_point():
        return float((got != want).float().mean())
    scale = want.float().abs().max().clamp_min(1e-30)
    return float((got.float() - want.float()).abs().max() / scale)


def shadow(ops, ref, worst: dict, calls: dict) -> None:
    for name in STATELESS:
        mine = getattr(ops, name, None)
        theirs = getattr(ref, name, None)
        if mine is None or theirs is None:
            continue

        def wrapped(*args, _mine=mine, _theirs=theirs, _name=name, **kw):
            want_args, want_kw = clone(args), clone(kw)
            got = _mine(*args, **kw)
            want = _theirs(*want_args, **want_kw)
            if _name == "router_topk":       # compare the chosen sets, then the weights in sorted order
                (gw, gi), (ww, wi) = got, want
                gi_s, go = gi.sort(-1)
                wi_s, wo = wi.sort(-1)
                errs = [rel(gi_s, wi_s), rel(gw.gather(-1, go), ww.gather(-1, wo))]
            else:
                errs = [rel(g, w) for g, w in zip(flat(got), flat(want))]
            calls[_name] += 1
            worst[_name] = max(worst.get(_name, 0.0), *errs) if errs else worst.get(_name, 0.0)
            if calls[_name] <= 2 or max(errs or [0]) > 0.05:
                rows = flat(args)[0].shape[0] if flat(args) else 0
                listed = ", ".join(f"{e:.2e}" for e in errs)
                print(f"  {_name} call {calls[_name]} rows {rows}: rel err {listed}", flush=True)
            return got

        setattr(ops, name, wrapped)


def main(spec: str, n: int, out: str | None) -> None:
    import kiln
    from kiln.backends.reference import ReferenceOps
    from kiln.weights.synth import random_prompt

    llm = kiln.load(spec, dtype="bf16", backend="cuda", enforce_eager=True)   # the shadow calls cannot live in a graph
    ops = llm.model.ops
    ref = ReferenceOps(ops.device if hasattr(ops, "device") else "cuda")
    worst, calls = {}, defaultdict(int)
    shadow(ops, ref, worst, calls)
    eng = llm.engine
    ids = random_prompt(n, llm.model.cfg.vocab_size, 0)
    state = eng.new_state(n + 4)
    logits = eng.prefill(ids, state)
    for k in range(3):
        logits = eng.decode_step(int(logits.argmax()), n + k, state)
    print("worst relative error per op (reference backend on the same inputs):")
    for name, e in sorted(worst.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {e:.3e}  ({calls[name]} calls)")
    if out:
        json.dump({"spec": spec, "tokens": n, "worst": worst, "calls": dict(calls)}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
