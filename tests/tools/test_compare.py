"""`kiln compare`: the near-tie rule on hand-made logits, kiln against transformers on synthesized
checkpoints of every family, a deliberately broken kiln caught, user mistakes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kiln
from kiln.backends.reference import ReferenceOps
from kiln.cli import main as cli_main
from kiln.models import MODEL_TYPES, model_config
from kiln.tools.compare import Greedy, judge, near_tie, ulp
from kiln.weights import synth
from kiln.weights.synth import Synthesis, write_checkpoint

pytest.importorskip("transformers")

TINY = [n for n in synth.CONFIGS if n.startswith("tiny-")]


def needs_family(name: str) -> None:
    mt = synth.CONFIGS[name]["model_type"]
    if mt not in MODEL_TYPES:
        pytest.skip(f"kiln has no model for {mt} yet")


# -- the near-tie rule -----------------------------------------------------------------------------

def test_ulp_is_2_to_the_exponent_minus_the_mantissa_bits():
    assert ulp(1.0, "bf16") == 2 ** -7 and ulp(1.99, "bf16") == 2 ** -7 and ulp(2.0, "bf16") == 2 ** -6
    assert ulp(-3.0, "f16") == 2 ** -9 and ulp(1.0, "f32") == 2 ** -23 and ulp(0.0, "bf16") == 0.0
    assert ulp(10.0, "bf16") == 2 ** -4 and ulp(0.3, "f32") == 2 ** -25


@pytest.mark.parametrize("x", [0.3, 1.0, 1.7, 7.9, 13.5, 100.0, 1000.0])
def test_ulp_is_the_spacing_of_the_dtypes_numbers(x):
    for dtype, tdt in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        v = float(torch.tensor(x).to(tdt))          # a representable value
        step = ulp(v, dtype)
        assert float(torch.tensor(v + step).to(tdt)) == v + step           # the next one up
        assert float(torch.tensor(v + 0.49 * step, dtype=torch.float64).to(tdt)) == v  # nothing in between
    v = np.float32(x)
    assert float(np.nextafter(v, np.float32(np.inf)) - v) == ulp(float(v), "f32")


def test_near_tie_is_within_one_ulp_at_the_top_logits_magnitude():
    assert near_tie([(3, 10.0), (4, 10.0 - 2 ** -4)], "bf16")          # one bf16 ulp in [8, 16)
    assert not near_tie([(3, 10.0), (4, 10.0 - 2 ** -3)], "bf16")      # two ulps
    assert near_tie([(3, 8.0), (4, 8.0 - 2 ** -4)], "bf16")            # across a binade edge: the larger one's ulp
    assert near_tie([(3, -0.5), (4, -0.5 - 2 ** -8)], "bf16")          # negative logits: |l2| is the larger
    assert not near_tie([(3, -0.5), (4, -0.5 - 2 ** -7)], "bf16")
    assert near_tie([(1, 5.0), (2, 5.0)], "f32")
    assert not near_tie([(1, 5.0), (2, 5.0 - 2 ** -19)], "f32")        # 4 f32 ulps
    assert near_tie([(1, 5.0), (2, 5.0 - 2 ** -19)], "bf16")


def _greedy(tokens, top2, forced):
    return Greedy(tokens, top2, torch.tensor(forced, dtype=torch.float32))


TIE, GAP = [(3, 10.0), (0, 10.0 - 2 ** -4)], [(3, 10.0), (0, 9.0)]
FORCED = [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0 - 2 ** -6], [0.0, 0.0, 0.0, 3.0]]


@pytest.mark.parametrize("at3, passes", [(TIE, True), (GAP, False)])
def test_judge_lets_only_near_tie_divergences_pass(at3, passes):
    ref = _greedy([1, 2, 3], [[(1, 1.0), (0, 0.0)], [(2, 2.0), (3, 1.0)], at3], FORCED)
    ours = _greedy([1, 2, 0], [[(1, 1.0), (0, 0.0)], [(2, 2.0), (3, 1.0)], [(0, 10.0), (3, 9.99)]], FORCED)
    r = judge(ref, ours, "bf16")
    assert r["identical"] == 2 and r["first_divergence"]["step"] == 2
    assert r["first_divergence"]["near_tie"] is passes and r["passed"] is passes
    assert r["teacher_forced"] == {"agree": 3, "near_ties": 0, "failures": []} and r["max_logit_err"] == 0


def test_judge_teacher_forced_mismatch_passes_only_at_a_near_tie():
    ref = _greedy([1, 2, 3], [[(1, 1.0), (0, 0.0)]] * 3, FORCED)
    at_tie = _greedy([1, 2, 3], ref.top2, [FORCED[0], [0.0, 0.0, 2.0 - 2 ** -6, 2.0], FORCED[2]])
    r = judge(ref, at_tie, "bf16")
    assert r["passed"] and r["teacher_forced"]["agree"] == 2 and r["teacher_forced"]["near_ties"] == 1
    assert r["max_logit_err"] == pytest.approx(2 ** -6 / 3.0)
    beyond = _greedy([1, 2, 3], ref.top2, [FORCED[0], FORCED[1], [0.0, 0.0, 4.0, 3.0]])
    r = judge(ref, beyond, "bf16")
    assert not r["passed"] and [f["step"] for f in r["teacher_forced"]["failures"]] == [2]


def test_a_backend_is_judged_at_its_products_precision_when_coarser():
    from kiln.tools.compare import _coarser
    assert _coarser("f32", "bf16") == "bf16" and _coarser("f32", "f16") == "f16" and _coarser("f32", None) == "f32"
    assert _coarser("bf16", "f16") == "bf16" and _coarser("f16", "bf16") == "bf16"


def test_cpu_backend_reports_its_products_precision():
    from kiln.backends.cpu import CpuOps
    ops = CpuOps()
    assert ops.compute_dtype is None
    ops.plan[(1, "decode")] = ("dense16", None, None)
    assert ops.compute_dtype == "f16"
    ops.plan[(2, "prefill")] = ("int4", None, None)
    assert ops.compute_dtype == "bf16"


# -- kiln against transformers ---------------------------------------------------------------------

def _compare(tmp_path, *args):
    report = tmp_path / "report.json"
    rc = cli_main(["compare", *args, "--device", "cpu", "--json", str(report), "--quiet"])
    return rc, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", TINY)
def test_compare_passes_on_every_family(name, dtype, tmp_path):
    """A 50-token prompt (past Gemma's window), 24 tokens: the teacher-forced prefill crosses the
    GDN chunk of 64."""
    needs_family(name)
    rc, report = _compare(tmp_path, f"synth:{name}", "--dtype", dtype, "--random-prompt", "50", "--tokens", "24")
    p = report["prompts"][0]
    assert rc == 0 and report["passed"] and p["passed"], p
    assert len(p["prompt_ids"]) == 50 and len(p["reference_tokens"]) == len(p["kiln_tokens"]) == 24
    if dtype == "f32":
        assert p["identical"] == 24 and p["teacher_forced"]["agree"] == 24 and p["max_logit_err"] < 1e-4
    else:   # the reference backend rounds where transformers rounds, on the same rows: the same bits
        assert p["identical"] == 24 and p["max_logit_err"] == 0, p["max_logit_err"]


def test_compare_kiln_side_is_what_generate_returns(tmp_path, capsys):
    rc, report = _compare(tmp_path, "synth:tiny-gemma3", "--prompt-ids", "5,6,7,8,9,10,11,12,13,14",
                          "--random-prompt", "12", "--seed", "4", "--tokens", "16")
    llm = kiln.load("synth:tiny-gemma3", device="cpu")
    assert rc == 0 and [p["prompt"] for p in report["prompts"]] == ["ids[10]", "random 12"]
    assert report["prompts"][1]["prompt_ids"] == synth.random_prompt(12, 317, seed=4)
    for p in report["prompts"]:
        assert p["kiln_tokens"] == llm.generate(p["prompt_ids"], max_new_tokens=16).token_ids
    out = capsys.readouterr().out
    assert "PASS" in out and "ids[10]" in out and "random 12" in out
    assert report["dtype"] == "f32" and report["versions"]["transformers"] and report["tokens"] == 16


def test_compare_runs_on_a_synthesized_folder(tmp_path):
    out = tmp_path / "m"
    assert cli_main(["synth", "tiny-llama", str(out), "--dtype", "f32", "--quiet"]) == 0
    rc, report = _compare(tmp_path, str(out), "--dtype", "f32", "--tokens", "16", "--random-prompt", "40")
    assert rc == 0 and report["prompts"][0]["identical"] == 16


def test_compare_catches_a_broken_kiln(tmp_path, monkeypatch, capsys):
    honest = ReferenceOps.logits

    def broken(self, x, w, softcap=None):  # kiln's logits only; transformers is untouched
        out = honest(self, x, w, softcap)
        return out + 3.0 * torch.cos(torch.arange(out.shape[-1], device=out.device) * 0.7).to(out.dtype)

    monkeypatch.setattr(ReferenceOps, "logits", broken)
    rc, report = _compare(tmp_path, "synth:tiny-llama", "--dtype", "f32", "--random-prompt", "30", "--tokens", "12")
    p = report["prompts"][0]
    assert rc == 1 and not report["passed"] and not p["passed"]
    assert p["first_divergence"] is not None and not p["first_divergence"]["near_tie"]
    assert p["teacher_forced"]["failures"] and p["max_logit_err"] > 0.1
    out = capsys.readouterr().out
    assert "FAIL" in out and "NOT a near-tie" in out


def test_compare_passes_tune_pins_and_retune_to_the_kiln_load(tmp_path, monkeypatch):
    """--tune OP=VARIANT and --retune reach kiln.load (they were once parsed and dropped). The load
    is stopped right there: only what it was asked for matters here."""
    import kiln.api
    import kiln.tools.compare
    from kiln.errors import KilnError

    seen = {}

    def spy(*args, **kw):
        seen.update(kw)
        raise KilnError("stopped by the test")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kiln.api, "load", spy)
    monkeypatch.setattr(kiln.tools.compare, "load", spy)     # the name compare calls it by
    _compare(tmp_path, "synth:tiny-llama", "--dtype", "f32", "--random-prompt", "20", "--tokens", "4",
             "--backend", "cuda", "--tune", "gemm=bm128_bn128_bk32_w4_s1", "--retune")
    assert seen["tune"] == {"gemm": "bm128_bn128_bk32_w4_s1"} and seen["retune"] is True


@pytest.mark.parametrize("args, says", [
    (["synth:tiny-llama", "--prompt", "hello"], "no tokenizer"),
    (["synth:tiny-llama", "--prompt-ids", "1,331"], "outside the vocabulary"),
    (["synth:tiny-llama", "--random-prompt", "1000"], "exceeds the max context"),
    (["synth:tiny-llama", "--tokens", "0"], "positive integer"),
    (["synth:nope"], "unknown synthesized model"),
])
def test_compare_user_mistakes_exit_2(args, says, tmp_path, capsys):
    rc, report = _compare(tmp_path, *args)
    err = capsys.readouterr().err
    assert rc == 2 and report is None and says in err and "Traceback" not in err


def test_compare_json_folder_must_exist_before_anything_runs(capsys):
    assert cli_main(["compare", "synth:tiny-llama", "--json", "/no/such/folder/r.json", "--quiet"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_compare_text_prompt_on_a_bundled_model(tmp_path):
    """Real weights (the bundled SmolLM2 GGUF, which transformers dequantises too) and a text prompt."""
    from kiln import hub

    hub.ensure("smollm2-135m")
    rc, report = _compare(tmp_path, "smollm2-135m", "--dtype", "f32", "--prompt", "The capital of France is",
                          "--tokens", "8")
    p = report["prompts"][0]
    assert rc == 0 and p["identical"] == 8 and len(p["prompt_ids"]) == 5


def test_compare_bf16_real_weights_are_the_same_bits(tmp_path):
    """gemma3-270m in bf16 on the reference backend: the same bits as transformers, teacher-forced
    logits too (both run the LM head on the same rows: a CPU GEMM's rounding depends on its row
    count, which made this 3.3e-3 when only kiln's side kept the generated rows)."""
    from kiln import hub

    hub.ensure("gemma3-270m")
    rc, report = _compare(tmp_path, "gemma3-270m", "--dtype", "bf16", "--backend", "reference", "--random-prompt", "40",
                          "--tokens", "8")
    p = report["prompts"][0]
    assert rc == 0 and p["identical"] == 8 and p["max_logit_err"] == 0, p["max_logit_err"]


def test_reference_runs_the_modeling_files_own_pytorch(monkeypatch):
    """With flash-linear-attention installed transformers would call it instead of its PyTorch GDN;
    the reference must not."""
    needs_family("tiny-qwen3.5")
    import functools
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    from kiln.tools.hf_reference import load_hf_reference

    @functools.wraps(inspect.unwrap(mod.torch_chunk_gated_delta_rule))
    def optional_kernel(*args, **kwargs):
        raise AssertionError("the optional kernel package was called")

    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", optional_kernel)
    ref = load_hf_reference("synth:tiny-qwen3.5", "f32", "cpu")
    with torch.no_grad():
        assert torch.isfinite(ref(torch.tensor([[1, 2, 3, 4, 5]])).logits).all()
    assert mod.torch_chunk_gated_delta_rule.__wrapped__ is inspect.unwrap(optional_kernel)


# -- --reference: kiln against kiln (a quantised model and its source; two backends) ------------------

@pytest.fixture(scope="module")
def source_and_quantised(tmp_path_factory):
    """A tiny Llama (dims multiples of 64, so every projection quantises) and `kiln quantize`'s 4-bit copy."""
    root = tmp_path_factory.mktemp("cmpq")
    config = dict(synth.CONFIGS["tiny-llama"], hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320)
    cls, cfg = model_config(config)
    src = write_checkpoint(Synthesis(config, cls.checkpoint_shapes(cfg), False, seed=3), root / "src", "tiny",
                           dtype="f32", quiet=True)
    assert cli_main(["quantize", str(src), str(root / "q4"), "--bits", "4", "--quiet"]) == 0
    return src, root / "q4"


def test_compare_against_the_source_reports_kl_without_a_verdict(source_and_quantised, tmp_path, capsys):
    src, quant = source_and_quantised
    rc, report = _compare(tmp_path, str(quant), "--reference", str(src), "--dtype", "f32", "--random-prompt", "20",
                          "--tokens", "8")
    p = report["prompts"][0]
    assert rc == 0 and report["judged"] is False and report["reference"] == str(src)
    assert p["reference_tokens"] == kiln.load(str(src), device="cpu", dtype="f32").generate(
        p["prompt_ids"], max_new_tokens=8).token_ids
    assert p["kiln_tokens"] == kiln.load(str(quant), device="cpu", dtype="f32").generate(
        p["prompt_ids"], max_new_tokens=8).token_ids
    assert 0 < p["mean_kl"] < 10 and np.isfinite(p["mean_kl"])     # 4 bits moves the distribution, not to nothing
    out = capsys.readouterr().out
    assert "REPORT" in out and "mean KL" in out and "PASS" not in out


def test_compare_of_one_model_against_itself_is_judged(source_and_quantised, tmp_path):
    """The same quantised weights on the same backend: identical tokens, KL 0, a PASS verdict."""
    _, quant = source_and_quantised
    rc, report = _compare(tmp_path, str(quant), "--reference", str(quant), "--dtype", "f32", "--random-prompt", "20",
                          "--tokens", "8")
    p = report["prompts"][0]
    assert rc == 0 and report["judged"] and report["passed"] and p["identical"] == 8 and p["mean_kl"] == 0
