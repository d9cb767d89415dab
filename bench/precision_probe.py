"""The reference's own bf16-vs-f32 spread beside kiln's distance from the reference, on one teacher-forced sequence.

How far apart do two valid bf16 runs of one model land? The numeric contract's rule for synthesized
weights (docs/synth.md) compares these two distances.

    PYTHONPATH=. python3 bench/precision_probe.py synth:qwen3.5-0.8b --tokens 256 [--device cpu]
        [--backend reference|cuda] [--reference hf|kiln] [--json OUT]

Runs one prefill of a random prompt through: transformers in f32, transformers in bf16, and kiln in
bf16; every position's logits. For each pair it reports the max logit error relative to the
f32 logits' scale and how many positions' argmax differ, split as `kiln compare` splits them:
near-tie (the reference's top two within one bf16 ulp) or not. If transformers' own bf16 run
differs from its f32 run beyond near-ties about as often as kiln differs from transformers' bf16,
kiln's remaining divergences are the model's bf16 noise, not a kiln defect. `contract` says whether
DESIGN.md's rule holds: beyond-near-tie flips no more than the reference's own, the max relative
error at most 1.1x its own.

`--reference kiln`: the reference runs are kiln's reference backend in f32 and bf16 instead of
transformers: the reference for quantised models (synth:NAME:bits=4, mlx-community folders), which
transformers does not run; it dequantises exactly as mlx does. A quantised synth spec must be packed
first (`kiln pack synth:NAME:bits=4 DIR`, then probe DIR): a spec draws its quantised values in the
load's dtype, so its f32 and bf16 runs would be two different models.
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
def kiln_logits(model_spec: str, ids: list[int], device: str, backend: str, dtype: str = "bf16") -> torch.Tensor:
    llm = kiln.load(model_spec, device=device, dtype=dtype, backend=backend)
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
    ap.add_argument("--reference", choices=["hf", "kiln"], default="hf",
                    help="the f32 and bf16 reference runs: transformers, or kiln's reference backend")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from kiln.api import resolve_model
    from kiln.weights import open_checkpoint

    path = a.model if a.model.startswith("synth:") else str(resolve_model(a.model))   # a bundled name: its file
    ids = random_prompt(a.tokens, open_checkpoint(path).config["vocab_size"], a.seed)
    if a.reference == "kiln" and a.model.startswith("synth:") and ":bits=" in a.model:
        sys.exit(f"precision_probe: pack {a.model} first (kiln pack SPEC DIR) and probe DIR: the spec draws its "
                 f"quantised values in the load's dtype, so its f32 and bf16 runs are two models")
    if a.reference == "hf":
        f32, bf16 = hf_logits(path, "f32", ids, a.device), hf_logits(path, "bf16", ids, a.device)
    else:
        f32, bf16 = (kiln_logits(a.model, ids, a.device, "reference", dt) for dt in ("f32", "bf16"))
    ours = kiln_logits(a.model, ids, a.device, a.backend)
    scale = float(f32.abs().max())
    ref = a.reference
    own, kiln_d = distance(f32, bf16, scale), distance(bf16, ours, scale)
    res = {"date": now_iso(), "command": " ".join(sys.argv), **environment(torch.device(a.device)), "model": a.model,
           "tokens": a.tokens, "device": a.device, "backend": a.backend, "reference": ref, "f32_logit_scale": scale,
           f"{ref}_bf16_vs_{ref}_f32": own,
           f"kiln_bf16_vs_{ref}_f32": distance(f32, ours, scale),
           f"kiln_bf16_vs_{ref}_bf16": kiln_d,
           "contract": {"holds": kiln_d["beyond_near_tie"] <= own["beyond_near_tie"]
                        and kiln_d["max_err_rel"] <= 1.1 * own["max_err_rel"],
                        "rule": "kiln vs the bf16 reference: beyond-near-tie flips <= the reference's bf16 vs f32, "
                                "max relative error <= 1.1x"}}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
