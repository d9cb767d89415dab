"""Does a streamed MoE model give the resident model's tokens, run after run, and when it does not, were
its weights changed? (bench/NOTES.md, 2026-12-06: 2 of 9 `kiln compare M --reference M
--expert-cache-slots 4` runs gave other tokens, wrong from the first decode step and in the
teacher-forced prefill too: persistent state, it seemed.)

    PYTHONPATH=. python3 bench/streamed_vs_resident.py MODEL OUT.json [RUNS] [SLOTS]

The resident model loads once: its greedy tokens and teacher-forced argmaxes for a random 64-token
prompt (kiln compare's kiln_greedy), and a checksum of every weight (per expert for the routed stacks).
Then RUNS times (default 6) a streamed model (SLOTS device slots a layer, default 4; the experts
homed in host memory) loads, runs the same, and its weights are checked before and after the run:
every non-expert weight against the resident's, every expert row of its host stacks against the
resident expert, every occupied slot against the expert the cache says it holds; and one more eager
teacher-forced pass with each layer's steps recorded (norm_next, linear_attention, full_attention,
norm_mlp, mlp) names the first that differs from the resident's. The JSON: per run the identical
tokens, the teacher-forced agreement, the names whose checksums differ and that first layer step.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

import kiln
from kiln.tools.benchutil import environment, now_iso
from kiln.tools.compare import kiln_greedy
from kiln.weights.quantized import QuantizedWeight

PROMPT, TOKENS = 64, 32
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")     # (CPU: a smoke run of the script)


def parts(w) -> list[torch.Tensor]:
    return [w.packed, w.scales, w.biases] if isinstance(w, QuantizedWeight) else [w]


def rows_sum(t: torch.Tensor) -> list[int]:
    """Per leading row, the sum of its bits as integers (exact, in any order), on the GPU."""
    out = []
    for i in range(0, t.shape[0], 16):      # a few experts at a time: host stacks move to the GPU in pieces
        x = t[i:i + 16].to(DEV)
        if x.is_floating_point():
            x = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
        out.append(x.to(torch.int64).reshape(x.shape[0], -1).sum(1).cpu())
    return torch.cat(out).tolist()


def stacked(w) -> bool:
    return (w.packed if isinstance(w, QuantizedWeight) else w).dim() == 3


def sums(w) -> list[list[int]]:
    """Each part's bit sums: per leading row for an [E, ...] stack (per expert), else one."""
    return [rows_sum(p if stacked(w) else p.reshape(1, -1)) for p in parts(w)]


def held(w) -> bool:
    return isinstance(w, (torch.Tensor, QuantizedWeight))


def resident_sums(model) -> dict:
    return {n: sums(w) for n, w in model.w.items() if held(w)}


def streamed_diffs(llm, want: dict) -> list[str]:
    """Names whose bit sums differ from the resident's: weights, host-stack experts, occupied slots."""
    bad, store = [], llm.model.expert_store
    bad += [n for n, w in llm.model.w.items() if held(w) and n in want and sums(w) != want[n]]
    for layer, home in store.homes.items():
        for n, stack in home.stacks.items():
            got = [rows_sum(p) for p in parts(stack)]
            rows = {e: e for e in range(len(got[0]))} if home.rows is None else home.rows
            bad += [f"host {n}[{e}]" for e, r in sorted(rows.items())
                    if any(got[p][r] != want[n][p][e] for p in range(len(got)))]
        for n, slots in store.stacks.get(layer, {}).items():
            got = [rows_sum(p) for p in parts(slots)]
            bad += [f"slot {n}[{s}] (expert {e})" for e, s in sorted(store.caches[layer].slot_of.items())
                    if any(got[p][s] != want[n][p][e] for p in range(len(got)))]
    return bad


TRACED = ("norm_next", "linear_attention", "full_attention", "norm_mlp", "mlp")


def flat(y) -> list[torch.Tensor]:
    if torch.is_tensor(y):
        return [y.detach().float().cpu()]
    return [t for v in (y if isinstance(y, (tuple, list)) else ()) for t in flat(v)]


@torch.inference_mode()
def traced(llm, seq: list[int]) -> list[tuple]:
    """One eager forward over seq (the teacher-forced pass), each layer step's outputs recorded:
    [(method, layer, tensors)] in call order."""
    model, eng, calls = llm.model, llm.engine, []
    for name in TRACED:
        real = getattr(model, name, None)
        if real is not None:
            setattr(model, name, lambda i, *a, _r=real, _n=name, **kw: (
                lambda y: (calls.append((_n, i, flat(y))), y)[1])(_r(i, *a, **kw)))
    try:
        model.forward(torch.tensor(seq, device=eng.device), torch.arange(len(seq), device=eng.device),
                      model.make_state(eng.dtype, eng.device), last_only=TOKENS)
    finally:
        for name in TRACED:
            model.__dict__.pop(name, None)
    return calls


def first_diff(want: list[tuple], got: list[tuple]) -> dict | None:
    """The first layer step whose outputs differ from the resident's, and by how much."""
    for (n, i, a), (m, j, b) in zip(want, got):
        if (n, i) != (m, j) or len(a) != len(b):
            return {"step": n, "layer": i, "why": f"calls differ: {(n, i)} vs {(m, j)}"}
        diffs = [float((x - y).abs().max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b)]
        if any(diffs):
            return {"step": n, "layer": i, "max_abs": diffs}
    return None


def agree(a, b) -> int:
    return int((a.forced.argmax(-1) == b.forced.argmax(-1)).sum())


def main(model: str, out: str, runs: int = 6, slots: int = 4) -> None:
    ref = kiln.load(model, dtype="bf16")
    ids = torch.randint(0, ref.model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    base = kiln_greedy(ref, ids, TOKENS, None)
    want = resident_sums(ref.model)
    seq = ids + base.tokens[:-1]
    steps = traced(ref, seq)
    env = environment(ref.engine.device)
    del ref
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    results = []
    for r in range(runs):
        llm = kiln.load(model, dtype="bf16", expert_cache_slots=slots)
        before = streamed_diffs(llm, want)
        got = kiln_greedy(llm, ids, TOKENS, base.tokens)
        after = streamed_diffs(llm, want)
        where = first_diff(steps, traced(llm, seq))
        same = next((i for i, (a, b) in enumerate(zip(base.tokens, got.tokens)) if a != b), TOKENS)
        res = {"run": r, "identical": same, "teacher_forced_agree": agree(base, got),
               "max_logit_err": float((base.forced - got.forced).abs().max()),
               "changed_before_run": before[:20], "changed_after_run": after[:20],
               "changed_counts": [len(before), len(after)], "first_layer_diff": where}
        results.append(res)
        print(json.dumps(res), file=sys.stderr, flush=True)
        del llm
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    doc = {"date": now_iso(), **env, "command": " ".join(sys.argv), "model": model, "slots": slots,
           "prompt_tokens": PROMPT, "tokens": TOKENS, "runs": results,
           "all_identical": all(r["identical"] == TOKENS and r["max_logit_err"] == 0 for r in results)}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
