"""The reference's own bf16-vs-f32 spread beside kiln's distance from the reference, on one teacher-forced sequence.

How far apart do two valid bf16 runs of one model land? The numeric contract's rule for synthesized
weights (docs/synth.md) compares these two distances.

    PYTHONPATH=. python3 bench/precision_probe.py synth:qwen3.5-0.8b --tokens 256 [--device cpu]
        [--backend reference|cuda] [--json OUT]

Runs one prefill of a random prompt through: transformers in f32, transformers in bf16, and kiln in
bf16; every position's logits. For each pair it reports the max logit error relative to the
f32 logits' scale and how many positions' argmax differ, split as `kiln compare` splits them:
near-tie (the reference's top two within one bf16 ulp) or not. If transformers' own bf16 run
differs from its f32 run beyond near-ties about as often as kiln differs from transformers' bf16,
kiln's remaining divergences are the model's bf16 noise, not a kiln defect.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import kiln
from kiln.tools.benchutil import environment, now_iso
from kiln.tools.compare import near_tie, top2
from kiln.tools.hf_reference import load_hf_reference
from kiln.weights.synth import random_prompt


@torch.inference_mode()
def hf_logits(model_spec: str, dtype: str, ids: list[int], device: str) -> torch.Tensor:
    model = load_hf_reference(model_spec, dtype=dtype, device=device)
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()
    del model
    return out


@torch.inference_mode()
def kiln_logits(model_spec: str, ids: list[int], device: str, backend: str) -> torch.Tensor:
    llm = kiln.load(model_spec, device=device, dtype="bf16", backend=backend)
    m, dev = llm.model, llm.engine.device
    out = m.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev),
                    m.make_state(llm.engine.dtype, dev), last_only=False).float().cpu()
    del llm
    return out


def distance(ref: torch.Tensor, other: torch.Tensor, scale: float) -> dict:
    """Max error relative to `scale`, and the argmax disagreements (near-tie or not, judged on ref)."""
    a, b = ref.argmax(-1), other.argmax(-1)
    misses = (a != b).nonzero().flatten().tolist()
    beyond = [k for k in misses if not near_tie(top2(ref[k]), "bf16")]
    return {"max_err_rel": round(float((other - ref).abs().max()) / scale, 5), "positions": ref.shape[0],
            "argmax_differ": len(misses), "beyond_near_tie": len(beyond)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from kiln.api import resolve_model
    from kiln.weights import open_checkpoint

    path = a.model if a.model.startswith("synth:") else str(resolve_model(a.model))   # a bundled name: its file
    ids = random_prompt(a.tokens, open_checkpoint(path).config["vocab_size"], a.seed)
    f32 = hf_logits(path, "f32", ids, a.device)
    bf16 = hf_logits(path, "bf16", ids, a.device)
    ours = kiln_logits(a.model, ids, a.device, a.backend)
    scale = float(f32.abs().max())
    res = {"date": now_iso(), "command": " ".join(sys.argv), **environment(torch.device(a.device)), "model": a.model,
           "tokens": a.tokens, "device": a.device, "backend": a.backend, "f32_logit_scale": scale,
           "hf_bf16_vs_hf_f32": distance(f32, bf16, scale),
           "kiln_bf16_vs_hf_f32": distance(f32, ours, scale),
           "kiln_bf16_vs_hf_bf16": distance(bf16, ours, scale)}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
