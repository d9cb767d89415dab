"""Teacher-forced check of a batched decode step against the single-request step, logits by logits.

    PYTHONPATH=. python3 bench/batch_check.py OUT.json [--model synth:qwen3.5-0.8b] [--batch 8] [--steps 32]

Each of `--batch` random prompts runs alone (eager single-row steps, its own state) for `--steps`
greedy tokens, keeping each step's logits; then the same prompts are prefilled again and fed the
same tokens through Engine.decode_batch. Per step: the largest |batched - alone| over the alone
logits' largest |value|, whether the argmax agrees, and where it does not, the alone top-2 margin
(a near-tie flips on rounding; a wrong state would disagree by far more than rounding).
"""

from __future__ import annotations

import argparse
import json

import torch

import kiln
from kiln.tools.benchutil import environment, now_iso


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:qwen3.5-0.8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()
    llm = kiln.load(a.model, device=a.device, quiet=False)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.model.cfg.vocab_size, (a.prompt_length,), generator=g).tolist()
               for _ in range(a.batch)]
    fresh = lambda: eng.capped(eng.model.make_state(eng.dtype, eng.device))       # noqa: E731
    alone_logits, fed = [], []
    with torch.inference_mode():
        for p in prompts:
            st = fresh()
            lg = eng.prefill(p, st)
            toks, rows = [], []
            for k in range(a.steps):
                tok = int(torch.argmax(lg))
                toks.append(tok)
                lg = eng._eager_step(tok, len(p) + k, st)
                rows.append(lg.float().cpu())
            alone_logits.append(rows)
            fed.append(toks)
        states = [fresh() for _ in prompts]
        for p, st in zip(prompts, states):
            eng.prefill(p, st)
        steps = []
        for k in range(a.steps):
            lg = eng.decode_batch([t[k] for t in fed], [len(p) + k for p in prompts], states).float().cpu()
            worst, flips = 0.0, []
            for j in range(a.batch):
                want = alone_logits[j][k].reshape(-1)
                got = lg[j].reshape(-1)
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
                if int(torch.argmax(got)) != int(torch.argmax(want)):
                    top = torch.topk(want, 2).values
                    flips.append({"request": j, "margin": round((top[0] - top[1]).item(), 5),
                                  "top": round(top[0].item(), 4)})
            steps.append({"step": k, "rel_err": worst, "flips": flips})
            print(json.dumps(steps[-1]), flush=True)
    report = {"model": a.model, "backend": llm.model.ops.name, "dtype": str(eng.dtype), **environment(eng.device),
              "date": now_iso(), "command": "python3 bench/batch_check.py " + " ".join(
                  f"{k}={v}" for k, v in vars(a).items()), "steps": steps}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
