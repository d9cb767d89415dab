"""`kiln bench` and `kiln profile` as a user runs them (CPU), plus the protocol on fake engines."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln import hub
from kiln.cli import main as kiln_main
from kiln.tools.bench import Baseline, run_protocol, summarise
from kiln.tools.benchutil import resident_fraction
from kiln.tools.profile import OpTimer

# expert_store: issue 21; first_token_s, prefill_graphs: 23; state_bytes: the window rings' bytes
BENCH_FIELDS = ["engine", "model", "dtype", "backend", "device", "gpu", "driver", "torch", "triton", "transformers",
                "kiln_commit", "kiln_env", "date", "command", "load_s", "load_stages", "first_token_s", "tune_s",
                "tune_cache", "peak_mem_gb", "state_bytes", "launches_per_token", "prefill_graphs", "quant",
                "bytes_per_token", "expert_store", "results", "baseline"]
RESULT_TYPES = {"prompt_tokens": int, "prefill_tok_s": float, "decode_tok_s": float, "gen_tokens": int}


def kiln(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def table_rows(stdout: str) -> list[list[str]]:
    """The Markdown table's cells, header first, the alignment rule dropped."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return [r for r in rows if not all(re.fullmatch(r"-+:?", c) for c in r)]


def num(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    """The issue's CPU acceptance command, run once for the tests below."""
    hub.ensure("smollm2-135m")
    d = tmp_path_factory.mktemp("bench")
    r = kiln("bench", "smollm2-135m", "--device", "cpu", "--prompt-lengths", "32,96", "--gen", "8", "--runs", "1",
             "--baseline", "transformers", "--json", "out.json", "--plot", "out.png", cwd=d)
    assert r.returncode == 0, r.stderr
    return r, d


def test_bench_prints_the_table_with_both_engines_and_ratios(acceptance):
    r, _ = acceptance
    head, *rows = table_rows(r.stdout)
    assert head[:4] == ["prompt tokens", "gen tokens", "kiln prefill tok/s", "kiln decode tok/s"]
    assert head[4:8] == ["transformers prefill tok/s", "transformers decode tok/s",
                         "prefill kiln/transformers", "decode kiln/transformers"]
    assert [row[0] for row in rows] == ["32", "96"] and all(row[1] == "8" for row in rows)
    for row in rows:
        assert min(map(num, row[2:8])) > 0


def test_bench_json_has_exactly_the_issue_fields_and_types(acceptance):
    r, d = acceptance
    rep = json.loads((d / "out.json").read_text())
    assert list(rep) == BENCH_FIELDS
    assert (rep["engine"], rep["model"], rep["dtype"], rep["backend"], rep["device"]) == (
        "kiln", "smollm2-135m", "f32", "cpu", "cpu")      # auto: the cpu backend for a GGUF file
    assert isinstance(rep["gpu"], str) and rep["gpu"] and rep["driver"] is None
    assert rep["torch"] == torch.__version__ and rep["transformers"] == importlib.metadata.version("transformers")
    assert rep["triton"] is None or isinstance(rep["triton"], str)
    assert rep["kiln_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rep["kiln_commit"])
    assert datetime.datetime.fromisoformat(rep["date"]).tzinfo is not None
    assert rep["command"].startswith("kiln bench smollm2-135m --device cpu --prompt-lengths 32,96")
    assert isinstance(rep["load_s"], float) and rep["load_s"] > 0
    # process start to the first token, less the weights stage: the imports and the load's other stages in it
    stages = rep["load_stages"] or {}
    assert rep["first_token_s"] > rep["load_s"] - stages.get("weights", 0.0) > 0
    assert rep["tune_s"] is None and rep["tune_cache"] is None and rep["launches_per_token"] is None
    assert rep["prefill_graphs"] is None      # the cpu backend captures no graph
    assert isinstance(rep["peak_mem_gb"], float) and 0.5 < rep["peak_mem_gb"] < 64  # 135M f32 weights alone are 0.54 GB
    # the last request's KV: 30 layers, K and V, 3 KV heads of 64 in f32, at the first capacity (256 >= 96 + 8)
    assert rep["state_bytes"] == 30 * 2 * 256 * 3 * 64 * 4
    base = rep["baseline"]
    assert list(base) == ["engine", "version", "results"] and base["engine"] == "transformers"
    assert base["version"] == importlib.metadata.version("transformers")
    assert rep["quant"]["bits"] == 4 and rep["quant"]["quantised"] > 0   # the cpu backend keeps the GGUF's tensors
    assert rep["expert_store"] is None                    # no experts streamed (tests/weights/test_experts.py)
    assert 0.10e9 < rep["bytes_per_token"] < 0.13e9        # Q4_1 projections, the Q8_0 tied embedding, as stored
    for results, extra in ((rep["results"], ["decode_of_bound"]), (base["results"], [])):
        assert [e["prompt_tokens"] for e in results] == [32, 96]
        for e in results:
            assert list(e) == list(RESULT_TYPES) + extra and all(type(e[k]) is t for k, t in RESULT_TYPES.items())
            assert e["gen_tokens"] == 8 and e["prefill_tok_s"] > 0 and e["decode_tok_s"] > 0
            assert e.get("decode_of_bound") is None         # no measured bandwidth for a CPU


def test_bench_table_and_json_say_the_same(acceptance):
    r, d = acceptance
    rep = json.loads((d / "out.json").read_text())
    _, *rows = table_rows(r.stdout)
    for row, k, b in zip(rows, rep["results"], rep["baseline"]["results"]):
        shown = list(map(num, row[2:6]))
        meant = [k["prefill_tok_s"], k["decode_tok_s"], b["prefill_tok_s"], b["decode_tok_s"]]
        assert shown == pytest.approx(meant, rel=0.01, abs=0.006)
        ratios = [k["prefill_tok_s"] / b["prefill_tok_s"], k["decode_tok_s"] / b["decode_tok_s"]]
        assert list(map(num, row[6:8])) == pytest.approx(ratios, abs=0.006)


def test_bench_plot_is_a_png_with_a_line_per_engine(acceptance):
    from PIL import Image

    _, d = acceptance
    with Image.open(d / "out.png") as im:
        assert im.format == "PNG" and im.size == (1200, 480)
        colors = {c for _, c in im.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # matplotlib's first two line colours
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]  # atomic writes left no temp file


def test_bench_stderr_says_page_cache_and_token_agreement(acceptance):
    r, _ = acceptance
    assert re.search(r"page cache (warm|cold|partly warm): \d+% of \d+ MB resident before load", r.stderr)
    assert re.search(r"greedy tokens at 32: kiln and transformers agree on the first \d of 8", r.stderr)
    assert "[bench] transformers 96 tok run 1/1: prefill" in r.stderr


def test_prompt_over_max_context_is_skipped_not_a_crash(tmp_path):
    r = kiln("bench", "smollm2-135m", "--device", "cpu", "--prompt-lengths", "16,96", "--gen", "4", "--runs", "1",
             "--max-context", "64", "--json", "out.json", "--quiet", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    head, short, long = table_rows(r.stdout)
    assert head[-1] == "note" and short[0] == "16" and num(short[2]) > 0 and short[-1] == ""
    assert long[0] == "96" and long[2:4] == ["skipped", "skipped"] and "max context of 64" in long[-1]
    res = json.loads((tmp_path / "out.json").read_text())["results"]
    assert res[1] == {"prompt_tokens": 96, "prefill_tok_s": None, "decode_tok_s": None, "gen_tokens": 0,
                      "skipped": "prompt 96 + 4 generated tokens exceed the max context of 64 tokens"}
    assert res[0]["prompt_tokens"] == 16 and res[0]["gen_tokens"] == 4 and res[0]["decode_tok_s"] > 0


def test_default_lengths_are_clipped_to_the_models_context(tmp_path):
    """No --prompt-lengths: the defaults that fit (512 in 600 tokens, with --gen 4) and the longest
    prompt that fits (596), every one measured; stderr says which defaults were dropped and why."""
    r = kiln("bench", "synth:tiny-llama", "--device", "cpu", "--max-context", "600", "--gen", "4", "--runs", "1",
             "--json", "out.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    head, *rows = table_rows(r.stdout)
    assert [row[0] for row in rows] == ["512", "596"] and head[-1] != "note"
    assert all(num(row[2]) > 0 and num(row[3]) > 0 for row in rows)
    said = [line for line in r.stderr.splitlines() if "2048, 8192, 32768, 81920" in line]
    assert len(said) == 1 and "max context of 600 tokens" in said[0] and "596" in said[0], r.stderr
    res = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [e["prompt_tokens"] for e in res] == [512, 596] and not any("skipped" in e for e in res)


def test_profile_prints_per_op_shares_that_sum_to_100(tmp_path):
    r = kiln("profile", "smollm2-135m", "--device", "cpu", "--prompt-length", "64", "--repeats", "1",
             "--json", "p.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    head, *rows = table_rows(r.stdout)
    assert head == ["op", "prefill calls", "prefill ms", "prefill share", "decode calls", "decode ms", "decode share"]
    ops = {row[0]: row for row in rows}
    assert {"linear", "attention", "rmsnorm", "apply_rope", "(outside ops)", "total"} <= set(ops)
    # SmolLM2's 30 layers: one attention each; linear calls nested in other ops (the LM head) count too
    assert ops["attention"][1] == ops["attention"][4] == "30"
    assert ops["linear"][1] == ops["linear"][4] and int(ops["linear"][1]) > 30
    body = [row for row in rows if row[0] != "total"]
    for col in (3, 6):
        assert sum(float(row[col].rstrip("%")) for row in body) == pytest.approx(100, abs=0.6)
    assert sum(num(row[2]) for row in body) == pytest.approx(num(ops["total"][2]), rel=1e-3, abs=0.01)
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["prefill_chunk"] == {"start": 0, "tokens": 64} and prof["decode_position"] == 64
    for step in ("prefill", "decode"):
        assert sum(o["share"] for o in prof[step]["ops"]) == pytest.approx(1.0, abs=1e-9)
        assert all(o["ms"] >= 0 for o in prof[step]["ops"] if o["op"] != "(outside ops)")


@pytest.mark.parametrize("args, says", [
    (["bench", "--prompt-lengths", "32,abc"], "--prompt-lengths"),
    (["bench", "--prompt-lengths", "0,32"], "positive integers"),
    (["bench", "--gen", "1"], "--gen"),
    (["bench", "--runs", "0"], "--runs"),
    (["bench", "--baseline", "llamacpp"], "invalid choice"),
    (["bench", "--dtype", "f64"], "invalid choice"),
    (["bench", "--plot", "out.jpg"], ".png"),
    (["bench", "--json", "/no/such/folder/out.json"], "does not exist"),
    (["profile", "--prompt-length", "-3"], "--prompt-length"),
    (["profile", "--json", "/no/such/folder/p.json"], "does not exist"),
    (["profile", "--max-context", "32", "--prompt-length", "64"], "does not fit"),
])
def test_bad_flags_exit_2_with_one_line_before_loading(args, says, monkeypatch, capsys):
    import kiln.api
    import kiln.cli.flags
    import kiln.tools.bench

    def no_load(*a, **k):
        raise AssertionError("a bad flag must be refused before the model loads")

    monkeypatch.setattr(kiln.api, "load", no_load)
    monkeypatch.setattr(kiln.api, "resolve_model", no_load)
    monkeypatch.setattr(kiln.cli.flags, "load", no_load)             # bench and profile load through it
    monkeypatch.setattr(kiln.tools.bench, "resolve_model", no_load)  # the name bench calls it by
    assert kiln_main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("kiln: error:") and says in err, err


def test_bad_flag_from_a_real_process():
    r = kiln("bench", "--gen", "0", timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr


# -- the protocol, on fake engines -----------------------------------------------------------------------
class FakeEngine:
    def __init__(self, name, calls, prefill_s, skip_at=()):
        self.name, self.calls, self.prefill_s, self.skip_at = name, calls, list(prefill_s), skip_at

    def measure(self, ids, gen):
        self.calls.append((self.name, len(ids)))
        if len(ids) in self.skip_at:
            return {"skipped": "out of memory"}
        return {"prefill_s": self.prefill_s.pop(0), "decode_s": 1.0, "tokens": [0] * gen}


def test_protocol_warms_up_then_alternates_which_engine_goes_first():
    calls = []
    a, b = FakeEngine("a", calls, [9] * 10), FakeEngine("b", calls, [9] * 10)
    run_protocol([a, b], {4: [1] * 4, 8: [1] * 8}, gen=3, runs=2, skips={})
    names = [n for n, _ in calls]
    # per length: warm-up a, b; then rounds alternate: a b | b a | a b | b a (the turn carries across lengths)
    assert names == ["a", "b", "a", "b", "b", "a", "a", "b", "a", "b", "b", "a"]
    assert [n for _, n in calls] == [4] * 6 + [8] * 6


def test_protocol_reports_the_median_and_skips_with_reasons():
    calls = []
    a = FakeEngine("a", calls, [99, 1.0, 4.0, 2.0])  # warm-up 99 s is not counted
    b = FakeEngine("b", calls, [], skip_at=(4,))
    out = run_protocol([a, b], {4: [1] * 4, 6: [1] * 6}, gen=5, runs=3, skips={6: "too long"})
    assert summarise(4, out["a"][4]) == {"prompt_tokens": 4, "prefill_tok_s": 2.0, "decode_tok_s": 4.0, "gen_tokens": 5}
    assert summarise(4, out["b"][4])["skipped"] == "out of memory"
    assert ("b", 4) in calls and calls.count(("b", 4)) == 1  # skipped at warm-up, never measured again
    assert summarise(6, out["a"][6]) == {"prompt_tokens": 6, "prefill_tok_s": None, "decode_tok_s": None,
                                         "gen_tokens": 0, "skipped": "too long"}
    assert ("a", 6) not in calls


def test_baseline_that_cannot_load_is_skipped_with_the_reason(tmp_path):
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    base = Baseline(str(bogus), "f32", "cpu", "sdpa")
    try:
        m = base.measure([1, 2, 3], 2)
    finally:
        base.close()
    assert base.version is None and base.proc.returncode is not None
    assert m["skipped"].startswith("transformers could not run the model: ") and len(m["skipped"]) > 40


# -- helpers -----------------------------------------------------------------------------------------------
def test_op_timer_charges_each_op_its_own_time_and_unwraps():
    class Ops:
        def outer(self):
            time.sleep(0.005)
            return self.inner()

        def inner(self):
            time.sleep(0.05)
            return 7

    ops = Ops()
    with OpTimer(ops, torch.device("cpu")) as timer:
        total, per_op = timer.step(lambda: ops.outer() + ops.inner())
    assert per_op["inner"][0] == 2 and per_op["outer"][0] == 1
    assert per_op["inner"][1] >= 100 and 5 <= per_op["outer"][1] < 50  # outer excludes inner's 50 ms
    assert per_op["inner"][1] + per_op["outer"][1] <= total
    assert vars(ops) == {}  # the wrappers are gone


def test_resident_fraction_sees_a_file_just_written(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * (1 << 20))
    f.read_bytes()
    frac, nbytes = resident_fraction(f)
    assert nbytes == 1 << 20 and 0.5 < frac <= 1.0
    assert resident_fraction(tmp_path / "missing") is None


def test_token_bytes_and_quant_summary_count_what_a_token_reads():
    """Quantised weights by their packed bytes, routed experts k / E, an embedding with its own LM head
    one row; the format holding most quantised bytes names the model's quantisation."""
    from types import SimpleNamespace

    from kiln.ops.quant.reference import quantize
    from kiln.tools.benchutil import quant_summary, token_bytes

    w = {"model.embed_tokens.weight": quantize(torch.randn(64, 128), 8, 64),        # 64 rows of 128 + 2 * 2 * 2 f32
         "lm_head.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
         "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 32, 128, dtype=torch.bfloat16),
         "model.layers.0.mlp.down_proj.weight": quantize(torch.randn(256, 128), 4, 64)}
    model = SimpleNamespace(cfg=SimpleNamespace(num_experts=8, num_experts_per_tok=2), w=w)
    row = (64 * 128 * 8 // 8 + 64 * 2 * 4 * 2) // 64
    want = row + 64 * 128 * 2 + 8 * 32 * 128 * 2 * 2 // 8 + 256 * 128 // 2 + 256 * 2 * 4 * 2
    assert token_bytes(model) == want
    assert quant_summary(model) == {"bits": 4, "group_size": 64, "bytes_per_token": want, "quantised": 2,
                                    "formats": ["4-bit g64", "8-bit g64"]}
    assert quant_summary(SimpleNamespace(w={"a": torch.zeros(2)})) is None


# -- the llama.cpp baseline ------------------------------------------------------------------------------
# A stand-in llama_cpp package: it records how it was built and every token list it evaluated (in the
# file $FAKE_LLAMA_LOG, since the worker is another process), and its greedy next token is the last
# token fed + 1, so the tokens a run reports show whether the argmax was read from its logits.
FAKE_LLAMA_CPP = '''
import ctypes, json, os

__version__ = "0.0-fake"
VOCAB = 64
_logits = (ctypes.c_float * VOCAB)()

def _log(event):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")

def llama_supports_gpu_offload():
    return False

def llama_get_logits_ith(ctx, i):
    assert ctx == "ctx" and i == -1
    return ctypes.cast(_logits, ctypes.POINTER(ctypes.c_float))

class Llama:
    def __init__(self, model_path, **kw):
        _log({"init": dict(kw, model_path=model_path)})
        self.ctx, self.n_tokens = "ctx", 0

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        _log({"eval": list(tokens), "n_past": self.n_tokens})
        self.n_tokens += len(tokens)
        for i in range(VOCAB):
            _logits[i] = 0.0
        _logits[(tokens[-1] + 1) % VOCAB] = 1.0
'''


TINY_GGUF = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen3.5.gguf"


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """The stand-in importable here and in bench's worker process; returns the events it logged."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "llama.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.syspath_prepend(str(pkg.parent))
    real = sys.modules.pop("llama_cpp", None)
    yield lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    sys.modules.pop("llama_cpp", None)      # the stand-in must not outlive the test
    if real is not None:
        sys.modules["llama_cpp"] = real


def test_llamacpp_baseline_feeds_the_ids_with_kilns_threads_and_reads_the_argmax(fake_llama_cpp):
    from kiln.tools import llamacpp_baseline

    ready, measure = llamacpp_baseline.load({"model": "m.gguf", "device": "cpu", "n_threads": 3, "n_ctx": 40})
    assert ready == {"version": "0.0-fake", "n_threads": 3}
    m = measure({"ids": [5, 9, 20], "gen": 4})
    assert m["tokens"] == [21, 22, 23, 24] and m["prefill_s"] > 0 and m["decode_s"] > 0
    init, *evals = fake_llama_cpp()
    assert init["init"] == {"model_path": "m.gguf", "n_ctx": 40, "n_batch": 512, "n_threads": 3,
                            "n_threads_batch": 3, "n_gpu_layers": 0, "logits_all": False, "verbose": False}
    assert evals == [{"eval": [5, 9, 20], "n_past": 0}, {"eval": [21], "n_past": 3},
                     {"eval": [22], "n_past": 4}, {"eval": [23], "n_past": 5}]
    measure({"ids": [7], "gen": 2})         # a new run starts from an empty cache
    assert fake_llama_cpp()[-2] == {"eval": [7], "n_past": 0}


def test_bench_with_the_llamacpp_baseline_reports_its_numbers(fake_llama_cpp, tmp_path, capsys):
    """The whole command in this process (on the 1 MB fixture GGUF, for speed), the fake library in the
    worker: the table's columns, the JSON's baseline section (with n_threads = kiln's torch threads),
    and the very ids kiln measured, from the very file kiln loaded."""
    from kiln.tools.bench import random_prompts

    out = tmp_path / "out.json"
    assert kiln_main(["bench", str(TINY_GGUF), "--device", "cpu", "--baseline", "llama.cpp", "--prompt-lengths",
                      "8,12", "--gen", "3", "--runs", "1", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    head, *rows = table_rows(captured.out)
    assert head[4:8] == ["llama.cpp prefill tok/s", "llama.cpp decode tok/s", "prefill kiln/llama.cpp",
                         "decode kiln/llama.cpp"]
    assert [row[0] for row in rows] == ["8", "12"] and all(min(map(num, row[2:6])) > 0 for row in rows)
    assert all(row[6] != "-" and row[7] != "-" for row in rows)     # the fake is fast: ratios may print 0.00
    rep = json.loads(out.read_text())
    assert list(rep) == BENCH_FIELDS
    base = rep["baseline"]
    assert list(base) == ["engine", "version", "n_threads", "results"]
    assert (base["engine"], base["version"], base["n_threads"]) == ("llama.cpp", "0.0-fake", torch.get_num_threads())
    assert [(e["prompt_tokens"], e["gen_tokens"]) for e in base["results"]] == [(8, 3), (12, 3)]
    assert all(e["prefill_tok_s"] > 0 and e["decode_tok_s"] > 0 for e in base["results"])
    events = fake_llama_cpp()
    assert events[0]["init"]["model_path"] == str(TINY_GGUF)
    assert events[0]["init"]["n_ctx"] == 12 + 3 and events[0]["init"]["n_threads"] == torch.get_num_threads()
    prompts = [e["eval"] for e in events if e.get("n_past") == 0]
    want = random_prompts(384, [8, 12], 0)            # the fixture's vocabulary
    assert prompts == [want[8]] * 2 + [want[12]] * 2            # warm-up and one run per length
    assert "greedy tokens at 8: kiln and llama.cpp agree on the first" in captured.err


@pytest.mark.parametrize("model, says", [
    ("synth:tiny-llama", "needs a GGUF model file; synth:tiny-llama is not one"),
    ("not-gguf.bin", "needs a GGUF model file"),
])
def test_llamacpp_baseline_refuses_a_model_that_is_not_gguf(model, says, fake_llama_cpp, tmp_path, monkeypatch,
                                                             capsys):
    import kiln.cli.flags

    monkeypatch.setattr(kiln.cli.flags, "load", lambda *a, **k: pytest.fail("refused before the model loads"))
    (tmp_path / "not-gguf.bin").write_bytes(b"PK\3\4" + b"\0" * 60)
    monkeypatch.chdir(tmp_path)
    assert kiln_main(["bench", model, "--baseline", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err


@pytest.mark.parametrize("baseline, module, says", [
    ("llama.cpp", "llama_cpp", "--baseline llama.cpp needs llama-cpp-python (pip install 'kiln[llamacpp]')"),
    ("transformers", "transformers", "--baseline transformers needs transformers"),
])
def test_a_missing_baseline_library_is_one_line_before_loading(baseline, module, says, monkeypatch, capsys):
    import kiln.cli.flags

    monkeypatch.setattr(kiln.cli.flags, "load", lambda *a, **k: pytest.fail("refused before the model loads"))
    monkeypatch.setitem(sys.modules, module, None)       # what find_spec reports for a library not installed
    assert kiln_main(["bench", "--baseline", baseline]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err


def test_llamacpp_baseline_on_the_real_library():
    """llama-cpp-python itself (skipped where it is not installed, as in CI) on the bundled GGUF."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from kiln.tools import llamacpp_baseline

    path = str(hub.ensure("smollm2-135m"))
    ready, measure = llamacpp_baseline.load({"model": path, "device": "cpu", "n_threads": 2, "n_ctx": 32})
    assert ready == {"version": llama_cpp.__version__, "n_threads": 2}
    ids = list(range(100, 116))
    first, again = measure({"ids": ids, "gen": 4}), measure({"ids": ids, "gen": 4})
    assert len(first["tokens"]) == 4 and first["tokens"] == again["tokens"]   # greedy: the same every run
    assert all(0 <= t < 49152 for t in first["tokens"]) and first["prefill_s"] > 0 and first["decode_s"] > 0
