"""`kiln compare MODEL`: kiln and the transformers reference on the same weights, greedy.

Per prompt: how many generated tokens are identical, the first divergence with both engines' top-2
logits and whether it is a near-tie, and a teacher-forced check: both engines run the reference's
whole sequence (prompt + its generated tokens) as one prefill, and at every generated position
kiln's argmax must equal the reference's unless the reference's top two are a near-tie there.

Near-tie: the reference's two largest logits l1 >= l2 have l1 - l2 <= ulp(max(|l1|, |l2|)), where
ulp(x) = 2^(floor(log2 |x|) - p) is the spacing of the dtype's numbers in the binade that holds |x|
and p its stored mantissa bits: 7 for bf16, 10 for f16, 23 for f32 (ulp(0) = 0). Exit code 1 when
a divergence (free-running or teacher-forced) is not a near-tie, 0 otherwise, 2 for user mistakes.
The reference runs first and is freed before kiln loads, so peak memory is one model, not two.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..api import load, load_tokenizer, pick_device, pick_dtype, resolve_model
from ..cli.flags import add_runtime_flags, nonneg_int, parse_pins, positive_int, token_ids
from ..errors import KilnError
from ..weights import open_checkpoint
from ..weights.synth import random_prompt
from .hf_reference import load_hf_reference, transformers_module

MANTISSA_BITS = {"bf16": 7, "f16": 10, "f32": 23}
_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def ulp(x: float, dtype: str) -> float:
    """One unit in the last place of `dtype` at magnitude |x|: 2^(floor(log2|x|) - mantissa bits)."""
    if x == 0 or not math.isfinite(x):
        return 0.0
    _, e = math.frexp(abs(x))  # |x| = m * 2^e with m in [0.5, 1), so floor(log2 |x|) = e - 1
    return math.ldexp(1.0, e - 1 - MANTISSA_BITS[dtype])


def top2(row: torch.Tensor) -> list[tuple[int, float]]:
    values, ids = row.float().topk(2)
    return [(int(ids[0]), float(values[0])), (int(ids[1]), float(values[1]))]


def near_tie(top: list[tuple[int, float]], dtype: str) -> bool:
    """The reference's top two logits are within one ulp of `dtype` at their magnitude."""
    (_, a), (_, b) = top
    return a - b <= ulp(max(abs(a), abs(b)), dtype)


# -- the two engines ---------------------------------------------------------------------------

@dataclass
class Greedy:
    tokens: list[int]                   # greedy continuation
    top2: list                          # per generated step: [(id, logit), (id, logit)]
    forced: torch.Tensor | None = None  # [N, V] f32: logits at the generated positions of the
                                        # reference's sequence, run as one prefill


@torch.inference_mode()
def reference_greedy(model, ids: list[int], n: int) -> Greedy:
    """transformers: prefill, then one token per step through its own cache; then teacher-forced."""
    dev, params = next(model.parameters()).device, inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    name = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
    x, cache, out = torch.tensor([ids], device=dev), None, Greedy([], [])
    for _ in range(n):
        step = model(input_ids=x, use_cache=True, **{name: cache}, **keep)
        cache, row = getattr(step, name), step.logits[0, -1]
        out.tokens.append(int(row.argmax()))
        out.top2.append(top2(row))
        x = torch.tensor([[out.tokens[-1]]], device=dev)
    # the LM head only at the n generated positions, as kiln_greedy asks (the same rows on both sides:
    # on CPU a GEMM's rounding depends on its row count)
    seq, keep = torch.tensor([ids + out.tokens[:-1]], device=dev), {"logits_to_keep": n} if keep else {}
    out.forced = model(input_ids=seq, use_cache=False, **keep).logits[0, -n:].float().cpu()
    return out


@torch.inference_mode()
def kiln_greedy(llm, ids: list[int], n: int, reference: list[int] | None) -> Greedy:
    """kiln's engine steps (chunked prefill, then decode steps), argmax; then one prefill over the
    reference's sequence (None: its own) with every position's logits."""
    eng, model = llm.engine, llm.model
    state = eng.new_state(len(ids) + n)
    logits, out = eng.prefill(ids, state), Greedy([], [])
    for k in range(n):
        out.tokens.append(int(logits.argmax()))
        out.top2.append(top2(logits))
        if k + 1 < n:
            logits = eng.decode_step(out.tokens[-1], len(ids) + k, state)
    seq = ids + (out.tokens if reference is None else reference)[:-1]
    # logits only at the n generated positions: every row of a 262,144-token vocabulary is 4 GB at 8k
    forced = model.forward(torch.tensor(seq, device=eng.device), torch.arange(len(seq), device=eng.device),
                           model.make_state(eng.dtype, eng.device), last_only=n)
    out.forced = forced.float().cpu()
    return out


def mean_kl(ref: Greedy, ours: Greedy) -> float:
    """Mean over the teacher-forced positions of KL(p_ref || p_ours), nats, softmax in f32."""
    p, q = torch.log_softmax(ref.forced.float(), -1), torch.log_softmax(ours.forced.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _coarser(a: str, b: str | None) -> str:
    """The coarser of two dtype names (fewer mantissa bits)."""
    return a if b is None or MANTISSA_BITS[a] <= MANTISSA_BITS[b] else b


def judge(ref: Greedy, ours: Greedy, dtype: str) -> dict:
    """One prompt's verdict: identical tokens, first divergence, teacher-forced agreement."""
    n = len(ref.tokens)
    same = next((k for k in range(n) if ours.tokens[k] != ref.tokens[k]), n)
    first = None
    if same < n:
        first = {"step": same, "reference": ref.top2[same], "kiln": ours.top2[same],
                 "near_tie": near_tie(ref.top2[same], dtype)}
    theirs, mine = ref.forced.argmax(-1).tolist(), ours.forced.argmax(-1).tolist()
    misses = [k for k in range(n) if mine[k] != theirs[k]]
    failures = [{"step": k, "reference": top2(ref.forced[k]), "kiln": top2(ours.forced[k])}
                for k in misses if not near_tie(top2(ref.forced[k]), dtype)]
    scale = float(ref.forced.abs().max())
    err = float((ours.forced - ref.forced).abs().max()) / scale if scale else 0.0
    return {"identical": same, "first_divergence": first,
            "teacher_forced": {"agree": n - len(misses), "near_ties": len(misses) - len(failures),
                               "failures": failures},
            "max_logit_err": err, "passed": (first is None or first["near_tie"]) and not failures}


# -- CLI ---------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="kiln against transformers on the same weights (greedy tokens)")
    add_runtime_flags(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", type=token_ids, default=[],
                   help="comma-separated token ids (repeatable)")
    p.add_argument("--random-prompt", action="append", type=positive_int, default=[], metavar="N",
                   help="N random token ids (repeatable; default one of 32)")
    p.add_argument("--tokens", type=positive_int, default=48, help="greedy tokens per prompt (default 48)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the full report as JSON")
    p.add_argument("--attn", default="eager", help="transformers attention implementation (default eager)")
    p.add_argument("--reference", default=None, metavar="SOURCE",
                   help="compare against SOURCE run by kiln instead of transformers (e.g. the unquantised model "
                        "of a quantised MODEL, same tokenizer; or MODEL itself on another backend): adds the mean "
                        "KL(SOURCE || MODEL) per token; a verdict only where SOURCE is MODEL")
    p.add_argument("--reference-backend", default="reference", choices=("reference", "cuda", "auto"),
                   help="the backend that runs --reference (default reference)")
    p.set_defaults(main=main)


def _prompts(a, ckpt) -> list[tuple[str, list[int]]]:
    vocab, out = int(ckpt.config["vocab_size"]), []
    tokenizer = load_tokenizer(ckpt) if a.prompt else None
    for text in a.prompt:
        if tokenizer is None:
            raise KilnError("this model has no tokenizer: use --prompt-ids or --random-prompt")
        if not text:
            raise KilnError("empty prompt")
        out.append((repr(text if len(text) <= 20 else text[:19] + "…"), tokenizer.encode(text)))
    for ids in a.prompt_ids:
        if max(ids) >= vocab:
            raise KilnError(f"token id {max(ids)} is outside the vocabulary [0, {vocab})")
        out.append((f"ids[{len(ids)}]", ids))
    for i, n in enumerate(a.random_prompt or ([] if out else [32])):
        out.append((f"random {n}", random_prompt(n, vocab, a.seed + i)))
    limit = min(int(ckpt.config.get("max_position_embeddings") or 1 << 62), a.max_context or 1 << 62)
    for label, ids in out:
        if len(ids) + a.tokens > limit:
            raise KilnError(f"prompt {label} ({len(ids)} tokens) + {a.tokens} tokens exceeds the max context {limit}")
    return out


def _fmt(top, digits: int) -> str:
    return " ".join(f"{i}:{v:.{digits}g}" for i, v in top)


def _row(label: str, r: dict, n: int, digits: int) -> str:
    d, tf = r["first_divergence"], r["teacher_forced"]
    div = "-" if d is None else (f"step {d['step']}: ref {_fmt(d['reference'], digits)} | kiln "
                                 f"{_fmt(d['kiln'], digits)} ({'near-tie' if d['near_tie'] else 'NOT a near-tie'})")
    ties = f" ({tf['near_ties']} near-tie)" if tf["near_ties"] else ""
    same, forced = f"{r['identical']}/{n}", f"{tf['agree']}/{n}{ties}"
    return f"{label:<24} {same:>9}  {forced:<22} {r['max_logit_err']:13.2e}  {'ok  ' if r['passed'] else 'FAIL'}  {div}"


def _write_json(path: str, report: dict) -> None:
    dest = Path(path).expanduser()
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, dest)
    except OSError as e:
        raise KilnError(f"cannot write {dest}: {e}") from None


def main(a) -> int:
    say = (lambda msg: None) if a.quiet else (lambda msg: print(f"kiln compare: {msg}", file=sys.stderr))
    if a.json and not Path(a.json).expanduser().parent.is_dir():
        raise KilnError(f"cannot write {a.json}: no such folder")
    dev = pick_device(a.device)
    dtype = _DTYPE_NAMES[pick_dtype(a.dtype, dev)]
    path = resolve_model(a.model, quiet=a.quiet)
    prompts = _prompts(a, open_checkpoint(path))
    tf = None if a.reference else transformers_module()     # kiln against kiln needs no transformers
    if a.quiet and tf is not None:
        tf.utils.logging.disable_progress_bar()

    t0 = time.perf_counter()
    if a.reference:
        ref = load(a.reference, device=str(dev), dtype=dtype, backend=a.reference_backend, quiet=a.quiet)
        if ref.config.vocab_size != int(open_checkpoint(path).config["vocab_size"]):
            raise KilnError(f"--reference {a.reference} has another vocabulary than {a.model or path}")
        say(f"reference: kiln {type(ref.model).__name__} on {a.reference_backend} loaded in "
            f"{time.perf_counter() - t0:.1f} s")
    else:
        ref = load_hf_reference(path, dtype, str(dev), a.attn)
        say(f"transformers {tf.__version__} {type(ref).__name__} loaded in {time.perf_counter() - t0:.1f} s")
    refs = []
    for k, (label, ids) in enumerate(prompts):
        refs.append(kiln_greedy(ref, ids, a.tokens, None) if a.reference else reference_greedy(ref, ids, a.tokens))
        say(f"reference: prompt {k + 1}/{len(prompts)} done")
    del ref  # one model in memory at a time
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    llm = load(path, device=str(dev), dtype=dtype, backend=a.backend, max_context=a.max_context, quiet=a.quiet,
               enforce_eager=getattr(a, "enforce_eager", False), retune=getattr(a, "retune", False),
               tune=parse_pins(getattr(a, "tune", None) or []), expert_cache_slots=a.expert_cache_slots,
               expert_policy=a.expert_policy, expert_home=a.expert_home, host_memory=a.host_memory,
               io_threads=a.io_threads, expert_profile=a.expert_profile, verify=a.verify, direct_io=a.direct_io,
               zero_copy=a.zero_copy, gpu_memory=a.gpu_memory)
    say(f"kiln {type(llm.model).__name__} loaded in {llm.load_s:.1f} s")
    # a backend whose products run coarser than the model's dtype (the cpu backend's bf16 forms) is
    # judged at that precision: the reference's near-ties are that precision's
    at = _coarser(dtype, getattr(llm.model.ops, "compute_dtype", None))
    results = []
    for (label, ids), r in zip(prompts, refs):
        ours = kiln_greedy(llm, ids, a.tokens, r.tokens)
        results.append({"prompt": label, **judge(r, ours, at), "mean_kl": mean_kl(r, ours), "prompt_ids": ids,
                        "reference_tokens": r.tokens, "kiln_tokens": ours.tokens})
    n, digits = a.tokens, 4 if dtype != "f32" else 8
    # Against other weights (a quantised model's source) a divergence is the point: measured, not judged.
    judged = not a.reference or resolve_model(a.reference, quiet=True) == path
    against = (f"kiln {a.reference} on {a.reference_backend}" if a.reference else
               f"transformers {tf.__version__} ({a.attn})")
    products = f" (products {at}: near-ties at {at})" if at != dtype else ""
    print(f"kiln compare {a.model or path} | {dev} {dtype}{products} | {n} greedy tokens | {against}")
    print(f"{'prompt':<24} {'identical':>9}  {'teacher-forced':<22} {'rel logit err':>13}  verdict, first divergence")
    for r in results:
        print(_row(r["prompt"], r, n, digits) + (f" | mean KL {r['mean_kl']:.3g}" if a.reference else ""))
    failed = [r for r in results if not r["passed"]] if judged else []
    if not judged:
        agree = sum(r["teacher_forced"]["agree"] for r in results) / (n * len(results))
        kl = sum(r["mean_kl"] for r in results) / len(results)
        print(f"REPORT (other weights, no verdict): teacher-forced top-1 agreement {agree:.1%}, mean KL {kl:.4g} nats")
    else:
        print(f"FAIL: {len(failed)} of {len(results)} prompts diverge beyond a near-tie" if failed else
              f"PASS: {len(results)} prompt(s), every divergence a near-tie")
    if a.json:
        _write_json(a.json, {
            "command": " ".join(["kiln", *sys.argv[1:]]), "model": str(a.model or path), "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "dtype": dtype, "tokens": n,
            "attn": a.attn, "reference": a.reference, "reference_backend": a.reference_backend if a.reference else None,
            "judged": judged, "judged_at": at, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"kiln": __version__, "torch": torch.__version__,
                         "transformers": tf.__version__ if tf is not None else None},
            "near_tie": "l1 - l2 <= 2^(floor(log2 max(|l1|,|l2|)) - p), p = 7 bf16 / 10 f16 / 23 f32",
            "prompts": results, "passed": not failed})
    return 1 if failed else 0
