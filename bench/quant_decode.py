"""Decode speed of a model with its projections quantised in memory, beside the same model in bf16.

    PYTHONPATH=. python3 bench/quant_decode.py MODEL OUT.json [--bits 4] [--group 64] [--prompt 512]

Loads MODEL (e.g. synth:qwen3.5-0.8b) on the cuda backend in bf16 and times greedy decode after a
random prompt; loads it again, quantises every 2-D projection and the embedding (what mlx-lm
quantises: Linear and Embedding weights whose input width is a multiple of the group) with kiln's
mx.quantize, re-tunes (the quantised GEMV's shapes come from the weights) and times it the same way.
Reports tok/s, the weight bytes a token reads and the fraction of the 4.27 TB/s bound, and how many
of the quantised run's greedy tokens equal the bf16 run's (random weights: a measure, not a check).
Until `kiln quantize` and the packed format land, this is how a quantised decode is measured.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kiln
from kiln.ops.quant import kernels
from kiln.ops.quant.reference import quantize
from kiln.tools.benchutil import environment, now_iso, token_bytes
from kiln.weights.quantized import QuantizedWeight
from kiln.weights.synth import random_prompt

HBM = 4.27e12


def quantise(model, bits: int, group: int) -> int:
    """Every 2-D weight of a projection or embedding quantised in place; how many."""
    n = 0
    for name, t in list(model.w.items()):
        if (isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] % 128 == 0 and "norm" not in name
                and "conv1d" not in name):
            model.w[name] = quantize(t, bits, group)
            n += 1
    if hasattr(model, "lm_head"):     # the model keeps its LM head (tied: the embedding) apart
        model.lm_head = model.w.get("lm_head.weight", model.w.get("model.embed_tokens.weight"))
    torch.cuda.empty_cache()
    return n


def timed(llm, prompt: list[int], gen: int) -> dict:
    llm.generate(prompt, max_new_tokens=gen, temperature=0)       # warm-up: the decode graph is captured
    out = llm.generate(prompt, max_new_tokens=gen, temperature=0)
    return {"decode_tok_s": out.stats.decode_tok_s, "prefill_tok_s": out.stats.prefill_tok_s,
            "tokens": out.token_ids}


def kernel_profile(llm, prompt: list[int], gen: int) -> list:
    """GPU microseconds a token per kernel name over a decode of `gen` tokens after a short prompt
    (its prefill is in the sums too: small against gen tokens), the 15 largest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt[:8], max_new_tokens=gen, temperature=0)
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name] = per.get(e.name, 0.0) + e.device_time / gen
    return sorted(([n[:60], round(us, 2)] for n, us in per.items()), key=lambda r: -r[1])[:15]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="also each run's kernels, GPU us a token")
    ap.add_argument("--forms", default="", help="only the qgemv variants whose names start so (comma-separated)")
    a = ap.parse_args()
    if a.forms:     # fewer candidates to compile and time
        kernels.OP.only = tuple(a.forms.split(","))
    runs = {}
    for kind in ("bf16", f"q{a.bits}g{a.group}"):
        t0 = time.perf_counter()
        llm = kiln.load(a.model, dtype="bf16", quiet=False)
        prompt = random_prompt(a.prompt, llm.config.vocab_size, 0)
        info = {}
        if kind != "bf16":
            info["quantised_weights"] = quantise(llm.model, a.bits, a.group)
            llm.model.ops.prepare(llm.model, torch.bfloat16, quiet=False)   # tune the qgemv shapes too
        info["load_s"] = time.perf_counter() - t0
        info.update(timed(llm, prompt, a.gen))
        if a.profile:
            info["kernels_us_per_token"] = kernel_profile(llm, prompt, a.gen)
            for name, us in info["kernels_us_per_token"]:
                print(f"  {us:8.2f} us  {name}", flush=True)
        nbytes = token_bytes(llm.model)
        info["bytes_per_token"] = nbytes
        info["bound_tok_s"] = HBM / nbytes
        info["of_bound"] = info["decode_tok_s"] / info["bound_tok_s"]
        info["quantised"] = sum(isinstance(t, QuantizedWeight) for t in llm.model.w.values())
        runs[kind] = info
        print(f"{kind}: decode {info['decode_tok_s']:.1f} tok/s, {nbytes / 1e9:.3f} GB a token, "
              f"{info['of_bound']:.0%} of the bound ({info['bound_tok_s']:.0f} tok/s)", flush=True)
        del llm
        torch.cuda.empty_cache()
    q = runs[f"q{a.bits}g{a.group}"]
    q["tokens_equal_bf16"] = sum(x == y for x, y in zip(q["tokens"], runs["bf16"]["tokens"]))
    out = {"command": f"bench/quant_decode.py {a.model} --bits {a.bits} --group {a.group} --prompt {a.prompt} "
                      f"--gen {a.gen}", "model": a.model, "date": now_iso(), **environment(torch.device("cuda")),
           "runs": runs}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
