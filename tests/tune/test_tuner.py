"""The tuner: the correctness gate rejects wrong candidates (also faster ones, also ones wrong only on
the partial block) and never times them; log lines in their contract shapes; the cache round-trips,
and a changed kernel source or version, or a corrupt file, means measuring again."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.backends.cuda import DECODE_ROWS, PREFILL_CHUNK, workloads  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.models import model_config  # noqa: E402
from kiln.ops.gemm import gemm  # noqa: E402
from kiln.ops.norm import kernels as norm_kernels  # noqa: E402
from kiln.tune import cache as tune_cache  # noqa: E402
from kiln.tune import gate, timing  # noqa: E402
from kiln.tune.device import device_info, interpreting  # noqa: E402
from kiln.tune.registry import extra_variant, variant  # noqa: E402
from kiln.tune.tuner import Plan, Tuner, Workload  # noqa: E402
from kiln.weights.synth import synth_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
SHAPE = gemm.GemmShape(100, 100, 40)          # full block 128 rows, partial block 100 rows
WORK = Workload(gemm.OP, SHAPE)
TIMES = re.compile(r"^\[autotune\] (\S+) (\S+): ((?:\S+ \d+\.\d+ ms, )*\S+ \d+\.\d+ ms) -> (\S+)$")
SUMMARY = re.compile(r"^\[kiln\] (\d+) kernels compiled in (\d+\.\d) s, tuned in (\d+\.\d) s "
                     r"\(cache (hit|miss): (.+)\)$")


def wrong_constant(inputs, outputs, plan):
    """Faster than any GEMM (one fill) and wrong everywhere."""
    outputs["y"].fill_(0.5)


def right_only_on_full_tiles(inputs, outputs, plan):
    """Fast and right on every full 64-row tile; rows past the last full tile left unwritten."""
    x, w, y = inputs["x"], inputs["w"], outputs["y"]
    full = x.shape[0] // 64 * 64
    y[:full] = F.linear(x[:full], w)


def torch_linear(inputs, outputs, plan):
    outputs["y"].copy_(F.linear(inputs["x"], inputs["w"]))


WRONG = variant("wrong_constant", run=wrong_constant)
PARTIAL = variant("right_only_on_full_tiles", run=right_only_on_full_tiles)
FAST = variant("torch_linear", run=torch_linear)


def tune(tmp_path, workloads=(WORK,), **kw):
    lines: list[str] = []
    kw.setdefault("cache", tune_cache.TuneCache(tmp_path / "tune", warn=lines.append))
    kw.setdefault("reps", 3 if DEVICE.type == "cpu" else None)   # a median, not one sample, on a busy CPU
    plan, report = Tuner(DEVICE, DTYPE, log=lines.append, **kw).tune(list(workloads))
    return plan, report, lines


def times_line(lines, label="gemm 100x100x40"):
    found = [m for line in lines if (m := TIMES.match(line)) and f"{m[1]} {m[2]}" == label]
    assert len(found) == 1, lines
    return found[0]


def planted_timer(monkeypatch, ms: dict[str, float]) -> list:
    """Replace the tuner's clock (timing.time_ms) with a planted one: each call still runs what it
    was handed once (as the real timer does), notes which variant that was, and returns ms[name]
    for it (1 ms for any variant not named: slower than every planted one). The wall clock of a
    CPU, loaded or not, decides nothing. Returns the variants timed, in order."""
    timed, ran, run = [], [], gemm.OP.run

    def run_noting(v, inputs, outputs, plan=None):
        ran.append(v)
        return run(v, inputs, outputs, plan)

    def time_ms(runs, device, reps=None):
        ran.clear()
        for r in runs:
            r()
        assert len(set(ran)) == 1, ran      # one variant per timing call
        timed.append(ran[0])
        return ms.get(ran[0].name, 1.0)

    monkeypatch.setattr(gemm.OP, "run", run_noting)
    monkeypatch.setattr(timing, "time_ms", time_ms)
    return timed


def test_gate_rejects_wrong_faster_candidates_on_full_and_partial_blocks(tmp_path, monkeypatch):
    """The two wrong candidates are the fastest by a planted timer (WRONG 1 us, PARTIAL 2 us, the
    right planted FAST 10 us, every other candidate 1 ms), so only the gate can keep them out: they
    are never timed and FAST wins. With the gate switched off, the same timer picks WRONG."""
    timed = planted_timer(monkeypatch, {WRONG.name: 0.001, PARTIAL.name: 0.002, FAST.name: 0.01})
    with extra_variant("gemm", WRONG), extra_variant("gemm", PARTIAL), extra_variant("gemm", FAST):
        plan, report, lines = tune(tmp_path)
    for name in (WRONG.name, PARTIAL.name):
        wrong = [line for line in lines if f"never picked: {name} " in line]
        assert len(wrong) == 1, lines
        assert re.fullmatch(rf"\[autotune\] gemm 100x100x40: wrong against trusted, never picked: {name} "
                            r"\(max err (\d\.\de[+-]\d\d|nan) of \d\.\de[+-]\d\d\)", wrong[0]), wrong[0]
    assert "max err nan" in next(line for line in lines if PARTIAL.name in line)     # unwritten rows stay NaN
    m = times_line(lines)
    logged = [part.rsplit(" ", 2)[0].rstrip("*") for part in m[3].split(", ")]
    assert logged == [v.name for v in timed] and FAST in timed                       # what was timed is logged
    assert WRONG not in timed and PARTIAL not in timed                                # never timed
    chosen = plan.choices["gemm 100x100x40"]
    assert chosen == FAST and m[4] == FAST.name and plan.times["gemm 100x100x40"] == 0.01
    assert report.rows == [("gemm 100x100x40", FAST.name, 0.01, "measured")]
    # The control: the same candidates and timer with every candidate passed by the gate. The wrong
    # one is timed and picked, so above it was the gate, not its speed, that kept it out.
    timed.clear()
    monkeypatch.setattr(gate, "check", lambda op, v, cases, plan=None: gate.Verdict(True, 0.0, 0.0))
    with extra_variant("gemm", WRONG), extra_variant("gemm", PARTIAL), extra_variant("gemm", FAST):
        plan, _, lines = tune(tmp_path / "ungated")
    assert WRONG in timed and PARTIAL in timed and plan.choices["gemm 100x100x40"] == WRONG, lines


def test_partial_block_catches_what_the_full_block_misses():
    dev = device_info(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cases = gate.trusted_cases(gemm.OP, SHAPE, gemm.OP.trusted(SHAPE, dev), DTYPE, DEVICE, gen)
    assert [c.shape.rows for c in cases] == [128, 100]
    assert gate.check(gemm.OP, PARTIAL, cases[:1]).ok                  # the full block alone passes it
    verdict = gate.check(gemm.OP, PARTIAL, cases)
    assert not verdict.ok and verdict.err != verdict.err            # NaN: rows left unwritten
    assert gate.check(gemm.OP, gemm.TRUSTED, cases).ok and gate.check(gemm.OP, FAST, cases).ok


def test_gate_threshold_is_one_64th_of_the_trusted_max():
    dev = device_info(DEVICE)
    cases = gate.trusted_cases(gemm.OP, SHAPE, gemm.OP.trusted(SHAPE, dev), DTYPE, DEVICE,
                               torch.Generator(device=DEVICE).manual_seed(1))

    def off_by(delta):
        def run(inputs, outputs, plan):
            y = F.linear(inputs["x"], inputs["w"])
            outputs["y"].copy_(y + delta * y.abs().max())
        return variant(f"off_{delta}", run=run)

    assert gate.check(gemm.OP, off_by(1 / 128), cases).ok
    assert not gate.check(gemm.OP, off_by(1 / 32), cases).ok


def test_timing_line_stars_the_fastest_and_picks_it(tmp_path):
    _, report, lines = tune(tmp_path)
    m = times_line(lines)
    parts = [p.rsplit(" ", 2) for p in m[3].split(", ")]
    times = {name.rstrip("*"): float(t) for name, t, _ in parts}
    starred = [name.rstrip("*") for name, _, _ in parts if name.endswith("*")]
    assert starred == [min(times, key=times.get)] == [m[4]]
    assert len(times) == len(Tuner(DEVICE, DTYPE).candidates(WORK)) >= 3
    s = SUMMARY.match(lines[-1])
    assert s and s[4] == "miss" and int(s[1]) == len(times) and s[5] == str(report.path)


def test_cache_round_trip_measures_nothing_the_second_time(tmp_path, monkeypatch):
    plan1, report1, _ = tune(tmp_path)
    assert report1.path.exists() and not report1.hit
    saved = json.loads(report1.path.read_text())
    assert saved["key"]["dtype"] == tune_cache.DTYPE_NAMES[DTYPE] and saved["key"]["gpu"] == device_info(DEVICE).name
    for k in ("sms", "capability", "driver", "cuda", "torch", "triton", "sources", "model"):
        assert k in saved["key"]

    def boom(*a, **k):
        raise AssertionError("a cache hit must not measure")
    monkeypatch.setattr(gate, "check", boom)
    monkeypatch.setattr(gate, "trusted_cases", boom)
    monkeypatch.setattr(timing, "time_ms", boom)
    plan2, report2, lines = tune(tmp_path)
    assert report2.hit and not [line for line in lines if line.startswith("[autotune]")]
    assert SUMMARY.match(lines[-1])[4] == "hit" and f"(cache hit: {report1.path})" in lines[-1]
    assert plan2.choices == plan1.choices
    with pytest.raises(AssertionError, match="must not measure"):   # --retune measures again
        tune(tmp_path, retune=True)


class EditableGemm(gemm.GemmOp):
    """The gemm op with a kernel source file of the test's own, to edit."""


def test_changed_kernel_source_invalidates_the_cache(tmp_path):
    src = tmp_path / "kernel.py"
    src.write_text("# version 1\n")
    op = EditableGemm()
    op.sources = (str(src),)
    work = Workload(op, SHAPE)
    _, first, _ = tune(tmp_path, [work])
    _, again, _ = tune(tmp_path, [work])
    assert not first.hit and again.hit
    src.write_text("# version 2\n")
    _, changed, lines = tune(tmp_path, [work])
    assert not changed.hit
    assert any("stale tune cache" in line and "sources" in line for line in lines)
    _, after, _ = tune(tmp_path, [work])
    assert after.hit


class EditableNorm(norm_kernels.RmsnormOp):
    """The rmsnorm op with a kernel source file of the test's own."""


def test_a_changed_source_measures_only_its_own_op_again(tmp_path, monkeypatch):
    """Sources are hashed per op: editing one op's kernel file re-measures that op's shapes and
    keeps the other ops' cached choices."""
    gemm_src, norm_src = tmp_path / "gemm.py", tmp_path / "norm.py"
    gemm_src.write_text("# gemm 1\n")
    norm_src.write_text("# norm 1\n")
    g, n = EditableGemm(), EditableNorm()
    g.sources, n.sources = (str(gemm_src),), (str(norm_src),)
    work = [Workload(g, SHAPE), Workload(n, norm_kernels.NormShape(5, 48, "llama"))]
    tune(tmp_path, work)
    norm_src.write_text("# norm 2\n")
    measured = []
    real = Tuner.measure
    monkeypatch.setattr(Tuner, "measure", lambda self, w, *a, **k: measured.append(w.op.name) or real(self, w, *a, **k))
    _, report, lines = tune(tmp_path, work)
    assert measured == [n.name] and not report.hit
    assert any("stale tune cache entries" in line and n.name in line for line in lines)
    measured.clear()
    _, report, _ = tune(tmp_path, work)
    assert report.hit and measured == []


def test_changed_versions_invalidate_the_cache(tmp_path, monkeypatch):
    tune(tmp_path)
    env = tune_cache.environment
    monkeypatch.setattr(tune_cache, "environment", lambda dev: {**env(dev), "triton": "0.0.0-test"})
    _, report, lines = tune(tmp_path)
    assert not report.hit and any("stale tune cache" in line and "triton" in line for line in lines)
    monkeypatch.setattr(tune_cache, "environment", lambda dev: {**env(dev), "torch": "0.0.0-test"})
    _, report, lines = tune(tmp_path)
    assert not report.hit and any("torch" in line for line in lines if "stale" in line)


def _measured(monkeypatch) -> list:
    measured = []
    real = Tuner.measure
    monkeypatch.setattr(Tuner, "measure", lambda self, w, *a, **k: measured.append(w.label) or real(self, w, *a, **k))
    return measured


def test_a_shape_tuned_for_one_model_is_not_measured_again_for_another(tmp_path, monkeypatch):
    """Another model (or context) that runs a shape already tuned under the same GPU, versions and
    kernel sources takes that choice from the other file; only its new shapes are measured, and
    its own file then holds everything (the next load is a plain hit)."""
    other = Workload(gemm.OP, gemm.GemmShape(24, 48, 40))
    plan1, first, _ = tune(tmp_path, [WORK])
    measured = _measured(monkeypatch)
    plan2, second, lines = tune(tmp_path, [WORK, other])
    assert measured == [other.label] and not second.hit and second.path != first.path
    assert any(line.startswith("[kiln] 1 choices from other models' tune caches") for line in lines)
    assert plan2.choices[WORK.label] == plan1.choices[WORK.label]
    measured.clear()
    _, third, lines = tune(tmp_path, [other])          # a third model: everything borrowed, a hit
    assert third.hit and measured == [] and third.path.exists()
    assert SUMMARY.match(lines[-1])[4] == "hit"


def test_a_tune_stopped_midway_keeps_what_it_measured(tmp_path, monkeypatch):
    """A long tune saves its measured choices as it goes (tuner.SAVE_EVERY_S): one killed (a timeout,
    Ctrl-C) loses only the shapes it had not reached; the next load measures just those."""
    from kiln.tune import tuner as tuner_module

    other = Workload(gemm.OP, gemm.GemmShape(24, 48, 40))
    monkeypatch.setattr(tuner_module, "SAVE_EVERY_S", 0.0)
    real, seen = Tuner.measure, []

    def stopped_at_the_second(self, w, *a, **k):
        if seen:
            raise KeyboardInterrupt
        seen.append(w.label)
        return real(self, w, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(Tuner, "measure", stopped_at_the_second)
        with pytest.raises(KeyboardInterrupt):
            tune(tmp_path, [WORK, other])
    measured = _measured(monkeypatch)
    plan, report, _ = tune(tmp_path, [WORK, other])
    assert len(seen) == 1 and measured == [w.label for w in (WORK, other) if w.label not in seen]
    assert not report.hit and set(plan.choices) == {WORK.label, other.label}


def test_choices_are_not_borrowed_across_versions_or_changed_sources(tmp_path, monkeypatch):
    src = tmp_path / "kernel.py"
    src.write_text("# version 1\n")
    op = EditableGemm()
    op.sources = (str(src),)
    mine, other = Workload(op, SHAPE), Workload(op, gemm.GemmShape(24, 48, 40))
    tune(tmp_path, [mine])
    measured = _measured(monkeypatch)
    src.write_text("# version 2\n")
    tune(tmp_path, [mine, other])                      # the first file's gemm sources differ
    assert sorted(measured) == sorted([mine.label, other.label])
    measured.clear()
    env = tune_cache.environment
    monkeypatch.setattr(tune_cache, "environment", lambda dev: {**env(dev), "triton": "0.0.0-test"})
    tune(tmp_path, [mine])                             # other versions: nothing to borrow
    assert measured == [mine.label]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_shape", "empty"])
def test_corrupt_or_partial_cache_file_is_ignored_with_a_warning(tmp_path, damage):
    _, report, _ = tune(tmp_path)
    text = report.path.read_text()
    report.path.write_text({"truncate": text[: len(text) // 2], "garbage": "\x00\x01 not json",
                            "wrong_shape": json.dumps({"key": 1, "entries": []}), "empty": ""}[damage])
    _, again, lines = tune(tmp_path)
    assert not again.hit and any("ignoring corrupt tune cache" in line for line in lines)
    _, healed, _ = tune(tmp_path)
    assert healed.hit


def test_concurrent_writers_leave_a_whole_file(tmp_path):
    cache = tune_cache.TuneCache(tmp_path, warn=lambda line: pytest.fail(line))
    key = {"gpu": "test gpu", "model": "m", "dtype": "f32", "sources": {"gemm": "0"}}
    big = {f"gemm {i}x1x1": {"variant": "v" * 200, "ms": i} for i in range(300)}

    def write(n):
        for i in range(20):
            cache.save(key, {**big, "writer": {"variant": f"{n}-{i}"}})
    threads = [threading.Thread(target=write, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for _ in range(50):   # readers during the writes never see half a file
        entries = cache.load(key)
        assert entries is None or len(entries) == 301
    for t in threads:
        t.join()
    assert cache.load(key)["writer"]["variant"].endswith("-19")
    assert [p.name for p in tmp_path.iterdir()] == [cache.path(key).name]   # no temporary files left


def test_pinned_variant_is_used_unmeasured_and_still_gated(tmp_path):
    pin = gemm.tile_variant(64, 128, 32, 4, 1) if DEVICE.type == "cpu" else gemm.tile_variant(64, 64, 64, 4, 4)
    plan, report, lines = tune(tmp_path, pins={"gemm": pin.name})
    assert plan.choices["gemm 100x100x40"] == pin and report.rows[0][3] == "pinned"
    assert not [line for line in lines if TIMES.match(line)]
    with extra_variant("gemm", WRONG):
        plan, _, lines = tune(tmp_path, pins={"gemm": WRONG.name})
    assert plan.choices["gemm 100x100x40"] == gemm.TRUSTED
    assert any(f"never picked: {WRONG.name}" in line for line in lines)
    with pytest.raises(KilnError, match="no such variant"):
        tune(tmp_path, pins={"gemm": "bm7_bn7"})


def test_budget_spent_takes_the_default_unmeasured(tmp_path, monkeypatch):
    """The default, gated, is kept as such: a load that measures nothing (budget 0) takes it again
    without gating it again; a load with a budget measures it; it is never shipped."""
    from kiln.tune import shipped

    default = gemm.OP.default(SHAPE, device_info(DEVICE))
    plan, report, lines = tune(tmp_path, budget_s=0.0)
    assert plan.choices["gemm 100x100x40"] == default
    assert report.rows[0][3] == "default" and any("budget" in line for line in lines)
    saved = json.loads(report.path.read_text())
    assert saved["entries"]["gemm 100x100x40"] == {"variant": default.name, "gated": True}
    with monkeypatch.context() as mp:
        mp.setattr(gate, "check", lambda *a, **k: pytest.fail("gated again"))
        plan, report, _ = tune(tmp_path, budget_s=0.0)
    assert report.hit and plan.choices["gemm 100x100x40"] == default and report.rows[0][3] == "cached"
    assert shipped.merge([saved], saved["key"]["sources"])["entries"] == {}
    _, report, lines = tune(tmp_path)
    assert report.rows[0][3] == "measured" and times_line(lines)
    assert "measured" in json.loads(report.path.read_text())["entries"]["gemm 100x100x40"]


def test_inputs_too_large_for_the_gpu_take_the_default_unmeasured(tmp_path, monkeypatch):
    """The 397B's moe workload drew its stacks whole (16 GiB in f32) beside 118 GiB of weights: the
    load died. An input set that does not fit now costs that workload its measurement, not the load."""
    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(gemm.OP, "inputs", no_room)
    plan, report, lines = tune(tmp_path)
    assert plan.choices["gemm 100x100x40"] == gemm.OP.default(SHAPE, device_info(DEVICE))
    assert report.rows[0][3] == "default"
    assert any("do not fit in the GPU memory left" in line for line in lines), lines
    assert not report.path.exists() or "gemm 100x100x40" not in json.loads(report.path.read_text())["entries"]


def test_plan_chooses_the_nearest_measured_rows_at_or_above():
    dev = device_info(DEVICE)
    plan = Plan(dev, DTYPE)
    a, b = gemm.tile_variant(16, 64, 64, 4, 1), gemm.tile_variant(128, 128, 32, 4, 1)
    plan.set(Workload(gemm.OP, gemm.GemmShape(1, 48, 40)), a)
    plan.set(Workload(gemm.OP, gemm.GemmShape(512, 48, 40)), b)
    assert [plan.choose(gemm.OP, gemm.GemmShape(m, 48, 40)) for m in (1, 2, 300, 512, 4096)] == [a, b, b, b, b]
    assert plan.choose(gemm.OP, gemm.GemmShape(7, 99, 40)) == gemm.OP.default(gemm.GemmShape(7, 99, 40), dev)
    # measured at one row only (the LM head's GEMV, which re-reads its weights per row): more rows take
    # the default, one row its choice
    plan.set(Workload(gemm.OP, gemm.GemmShape(1, 64, 40)), a)
    assert plan.choose(gemm.OP, gemm.GemmShape(32, 64, 40)) == gemm.OP.default(gemm.GemmShape(32, 64, 40), dev)
    assert plan.choose(gemm.OP, gemm.GemmShape(1, 64, 40)) == a


def test_batch_buckets_and_their_workloads():
    from kiln.backends.cuda import batch_buckets

    assert batch_buckets(1) == () and batch_buckets(2) == (2,) and batch_buckets(4) == (4,)
    assert batch_buckets(32) == (4, 16, 32) and batch_buckets(64) == (4, 16, 64)
    cls, cfg = model_config(synth_config("qwen3.5-0.8b"))
    work = workloads(cls, cfg, (4, 16), ops=("gemm",))
    assert {4, 16} <= {w.shape.rows for w in work}


def test_the_routed_experts_are_also_tuned_at_the_prefill_graphs_buckets():
    """With a 4,096-row chunk the moe op (only it) is measured at 1,024 and 2,048 rows too."""
    from kiln.backends.cuda import CudaOps

    ops = CudaOps.__new__(CudaOps)
    ops.prefill_chunk, ops.off = 4096, frozenset()
    cls, cfg = model_config(synth_config("qwen3.5-35b-a3b"))
    work = ops.dense_workloads(cls, cfg)
    rows = lambda name: {w.shape.rows for w in work if w.op.name == name}   # noqa: E731
    assert rows("moe") == {1, 512, 1024, 2048, 4096} and rows("gemm") == {1, 512, 4096}
    assert {w.shape.rows for w in ops.dense_workloads(cls, cfg, m_values=(4096, 1)) if w.op.name == "moe"} == {1, 4096}


def test_workloads_of_qwen35_08b_are_its_projections():
    cls, cfg = model_config(synth_config("qwen3.5-0.8b"))
    work = workloads(cls, cfg, (PREFILL_CHUNK, DECODE_ROWS))
    gemms = {(w.shape.rows, w.shape.n, w.shape.k) for w in work if w.op.name == "gemm"}
    prefill = {(n, k) for m, n, k in gemms if m == 512}
    # GDN qkv|z|b|a (6144 + 2048 + 16 + 16) and out; attention q(+gate)|k|v (4096 + 512 + 512) and o;
    # MLP gate|up (2 x 3584) and down: projections of one input run as one concatenated GEMM
    assert prefill == {(8224, 1024), (1024, 2048), (5120, 1024), (7168, 1024), (1024, 3584)}
    assert {(n, k) for m, n, k in gemms if m == 1} == prefill | {(248320, 1024)}    # + the LM head
    norms = {(w.shape.rows, w.shape.d, w.shape.style) for w in work if w.op.name == "rmsnorm"}
    assert {(512, 1024, "offset"), (512 * 8, 256, "offset"), (512 * 2, 256, "offset"), (1, 1024, "offset")} <= norms
    # the final norm with the LM head; at decode, each mixer's first projections with the residual
    # add and its input norm (and the MLP's gate|up with the post-attention one, where gemm_act is tuned)
    fused = {(w.shape.rows, w.shape.n, w.shape.k, w.shape.style, w.shape.add) for w in work
             if w.op.name == "rmsnorm_gemm"}
    decode = {(1, 8224, 1024, "offset", True), (1, 5120, 1024, "offset", True), (1, 7168, 1024, "offset", True)}
    assert fused == {(1, 248320, 1024, "offset", False)} | (set() if interpreting() else decode)


def test_tune_skip_keeps_a_named_variant_from_running(monkeypatch):
    """KILN_TUNE_SKIP=op=variant: a variant that faults on some GPU never compiles or runs."""
    from kiln.tune.registry import candidates

    shape, dev = norm_kernels.NormShape(8, 64, "llama"), device_info("cpu")
    names = [v.name for v in candidates(norm_kernels.OP, shape, dev)]
    monkeypatch.setenv("KILN_TUNE_SKIP", f"rmsnorm={names[1]}, gemm={names[0]}")
    left = [v.name for v in candidates(norm_kernels.OP, shape, dev)]
    assert left == [n for n in names if n != names[1]]


def test_a_variant_that_faults_the_device_stops_the_tune_and_names_the_skip(tmp_path, monkeypatch):
    """An illegal address poisons the CUDA context: the tune stops with one line that names the variant
    and the KILN_TUNE_SKIP setting, instead of failing later somewhere unrelated."""
    from kiln.errors import KilnError

    victim = Tuner(DEVICE, DTYPE).candidates(WORK)[1]
    real = gemm.OP.compile

    def compile(v, *a, **k):
        if v == victim:
            raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
        return real(v, *a, **k)
    monkeypatch.setattr(gemm.OP, "compile", compile)
    with pytest.raises(KilnError, match=f"KILN_TUNE_SKIP=gemm={victim.name}"):
        tune(tmp_path)


def test_a_variant_that_faults_in_the_gate_stops_the_tune(tmp_path):
    def faulting(inputs, outputs, plan):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    from kiln.errors import KilnError
    from kiln.tune.registry import extra_variant

    with extra_variant("gemm", variant("faulting", run=faulting)):
        with pytest.raises(KilnError, match="KILN_TUNE_SKIP=gemm=faulting"):
            tune(tmp_path)


def test_compiled_kernels_default_to_the_kiln_cache_dir(tmp_path):
    """Without TRITON_CACHE_DIR, Triton's kernels go under $KILN_CACHE_DIR/triton; a set one is kept."""
    import subprocess
    import sys

    code = "import os, kiln.ops.common; print(os.environ['TRITON_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"} | {"KILN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "triton")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "mine")


# -- shipped choices (kiln/tune/shipped) ------------------------------------------------------------

def _ship(tmp_path, monkeypatch, variant_name: str | None = None, work=WORK):
    """A shipped file for this device made from a real tune (tools/ship_tune.py's merge), its
    choice replaced by `variant_name` when given; kiln's shipped folder pointed at it."""
    from kiln.tune import shipped
    _, report, _ = tune(tmp_path / "measured", [work])
    data = json.loads(report.path.read_text())
    made = shipped.merge([data], tune_cache.sources_hash([work.op]))
    if variant_name is not None:
        made["entries"][work.label]["variant"] = variant_name
    monkeypatch.setattr(shipped, "ROOT", tmp_path / "shipped")
    target = shipped.path(made["key"])
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps(made))
    return made["entries"][work.label]["variant"]


def test_a_shipped_choice_is_gated_not_timed_and_kept_in_the_users_cache(tmp_path, monkeypatch):
    chosen = _ship(tmp_path, monkeypatch)
    gated = []
    check = gate.check
    monkeypatch.setattr(gate, "check", lambda op, v, *a, **k: gated.append(v.name) or check(op, v, *a, **k))

    def boom(*a, **k):
        raise AssertionError("a shipped choice must not be timed")
    monkeypatch.setattr(timing, "time_ms", boom)
    plan, report, lines = tune(tmp_path / "cold")
    assert plan.choices[WORK.label].name == chosen and gated == [chosen]
    assert report.shipped == 1 and not report.hit and report.rows[0][3] == "shipped"
    assert SUMMARY.match(lines[-1]) and "1 shipped choices gated, not timed" in lines[-1]
    saved = json.loads(report.path.read_text())["entries"][WORK.label]
    assert saved["variant"] == chosen and saved["shipped"] is True
    gated.clear()
    _, again, _ = tune(tmp_path / "cold")              # the next load: a plain cache hit
    assert again.hit and again.shipped == 0 and gated == []


def test_a_gated_default_yields_to_a_measured_choice_borrowed_or_shipped(tmp_path, monkeypatch):
    """A default cached as gated (a spent budget) is not the last word: another model's measured
    choice of the shape is borrowed over it, and a shipped choice is taken over it, also by a load
    that measures nothing (budget 0)."""
    other = Workload(gemm.OP, gemm.GemmShape(24, 48, 40))
    _, both, _ = tune(tmp_path, [WORK, other], budget_s=0.0)
    assert all(e.get("gated") for e in json.loads(both.path.read_text())["entries"].values())
    _, alone, _ = tune(tmp_path, [WORK])                   # another model, with a budget: measures WORK
    chosen = json.loads(alone.path.read_text())["entries"][WORK.label]
    assert "measured" in chosen
    measured = _measured(monkeypatch)
    plan, again, lines = tune(tmp_path, [WORK, other], budget_s=0.0)
    assert measured == [] and plan.choices[WORK.label].name == chosen["variant"]
    assert any(line.startswith("[kiln] 1 choices from other models' tune caches") for line in lines)
    assert [r[3] for r in again.rows] == ["cached", "cached"]
    shipped_choice = _ship(tmp_path / "s", monkeypatch, work=other)
    plan, third, _ = tune(tmp_path, [WORK, other], budget_s=0.0)
    assert plan.choices[other.label].name == shipped_choice and third.shipped == 1
    assert dict((r[0], r[3]) for r in third.rows)[other.label] == "shipped"


def test_a_wrong_shipped_choice_is_never_run_and_the_shape_is_measured(tmp_path, monkeypatch):
    with extra_variant("gemm", WRONG):
        _ship(tmp_path, monkeypatch, WRONG.name)
        measured = _measured(monkeypatch)
        plan, report, lines = tune(tmp_path / "cold")
    assert any(f"never picked: {WRONG.name}" in line for line in lines)
    assert measured == [WORK.label] and plan.choices[WORK.label] != WRONG
    assert report.rows[0][3] == "measured" and report.shipped == 0 and "shipped choices" not in lines[-1]


def test_shipped_choices_of_another_triton_or_changed_kernels_or_retune_are_not_used(tmp_path, monkeypatch):
    src = tmp_path / "kernel.py"
    src.write_text("# version 1\n")
    op = EditableGemm()
    op.sources = (str(src),)
    work = Workload(op, SHAPE)
    _ship(tmp_path, monkeypatch, work=work)
    _, report, _ = tune(tmp_path / "a", [work])
    assert report.shipped == 1
    _, report, _ = tune(tmp_path / "b", [work], retune=True)         # --retune measures everything
    assert report.shipped == 0 and report.rows[0][3] == "measured"
    env = tune_cache.environment
    monkeypatch.setattr(tune_cache, "environment", lambda dev: {**env(dev), "triton": "0.0.0-test"})
    _, report, _ = tune(tmp_path / "c", [work])
    assert report.shipped == 0 and report.rows[0][3] == "measured"
    monkeypatch.setattr(tune_cache, "environment", lambda dev: {**env(dev), "driver": "0.0-test", "torch": "0.0-test"})
    _, report, _ = tune(tmp_path / "d", [work])                      # versions that move timings only
    assert report.shipped == 1
    src.write_text("# version 2\n")
    _, report, _ = tune(tmp_path / "e", [work])
    assert report.shipped == 0 and report.rows[0][3] == "measured"


def test_merging_tune_caches_keeps_only_choices_of_todays_kernels():
    from kiln.tune import shipped
    key = {"format": tune_cache.FORMAT, "gpu": "G", "sms": 2, "capability": "9.0", "driver": "1", "cuda": "13",
           "torch": "2", "triton": "3", "dtype": "bf16", "model": "m1", "sources": {"gemm": "a", "rmsnorm": "old"}}
    one = {"key": key, "entries": {"gemm 1x8x8": {"variant": "v1", "ms": 0.1, "measured": {"v1": 0.1}},
                                   "rmsnorm 1x8": {"variant": "n1", "ms": 0.2}}}
    two = {"key": {**key, "model": "m2", "torch": "2.1"}, "entries": {"gemm 1x8x8": {"variant": "v2", "ms": 0.09}}}
    made = shipped.merge([one, two], {"gemm": "a", "rmsnorm": "new"})
    assert made["entries"] == {"gemm 1x8x8": {"variant": "v2", "ms": 0.09}}
    assert made["key"] == {"format": tune_cache.FORMAT, "gpu": "G", "sms": 2, "capability": "9.0", "triton": "3",
                           "dtype": "bf16", "sources": {"gemm": "a"}}
    with pytest.raises(ValueError, match="another gpu"):
        shipped.merge([one, {**two, "key": {**two["key"], "gpu": "H"}}], {"gemm": "a"})


# -- compiling while the weights load (Tuner.precompile) --------------------------------------------
def test_precompile_submits_what_tune_compiles_in_workers_and_tune_waits_for_it(tmp_path, monkeypatch):
    """kiln.load calls precompile before the weights: it submits to worker processes exactly the
    jobs tune() would compile there (each candidate, its kernels loaded there too), and tune() then
    collects them instead of compiling them again; the summary line counts them."""
    lines: list[str] = []
    tuner = Tuner(DEVICE, DTYPE, log=lines.append, budget_s=0,
                  cache=tune_cache.TuneCache(tmp_path / "tune", warn=lines.append))
    monkeypatch.setattr(tuner, "_workers", lambda jobs: 2 if jobs else 1)     # off a GPU: no workers
    _, _, _, pinned, cached, _, ship, todo = tuner._split([WORK])
    want = {k for k, j in tuner.compile_jobs(todo, cached, pinned, ship)[0].items() if j[2].run is None}
    assert tuner.precompile([WORK]) == len(want) > 0 and set(tuner._early.values()) == want
    again: list = []
    monkeypatch.setattr(tuner, "compile_in_workers", lambda work, workers: again.append(work) or {})
    plan, report = tuner.tune([WORK])
    assert again == [], again
    assert report.early == len(want) and not tuner._early and WORK.label in plan.choices
    assert f"; {len(want)} compiled while the weights loaded)" in lines[-1]


def test_precompiles_workers_exit_once_their_jobs_are_done(tmp_path, monkeypatch):
    """Each worker holds a CUDA context (0.5-2.7 GB on the H200): once precompile's jobs are done they
    exit while the weights still load, without waiting for tune() (the 397B's load ran out of GPU
    memory beside 16 idle workers)."""
    tuner = Tuner(DEVICE, DTYPE, log=lambda line: None, budget_s=0,
                  cache=tune_cache.TuneCache(tmp_path / "tune"))
    monkeypatch.setattr(tuner, "_workers", lambda jobs: 2 if jobs else 1)
    assert tuner.precompile([WORK]) > 0
    procs = tuner._pool._processes          # None once the pool has shut down (the jobs may be that quick)
    workers = list(procs.values()) if procs else []
    assert all(f.result(timeout=120) is None for f in tuner._early)
    deadline = time.monotonic() + 60
    while tuner._pool._processes is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tuner._pool._processes is None   # shut down without tune(): its processes joined
    assert not any(p.is_alive() for p in workers)
    plan, report = tuner.tune([WORK])        # tune() still collects the finished jobs
    assert report.early > 0 and WORK.label in plan.choices


def test_a_cancelled_precompile_leaves_tune_compiling_everything(tmp_path, monkeypatch):
    """A load that fails in its weights drops precompile's jobs: a later tune() compiles as if none
    had been started."""
    tuner = Tuner(DEVICE, DTYPE, log=lambda line: None, budget_s=0,
                  cache=tune_cache.TuneCache(tmp_path / "tune"))
    monkeypatch.setattr(tuner, "_workers", lambda jobs: 2 if jobs else 1)
    assert tuner.precompile([WORK]) > 0
    tuner.cancel()
    assert not tuner._early
    seen: list = []
    monkeypatch.setattr(tuner, "compile_in_workers", lambda work, workers: seen.append(set(work)) or {})
    _, report = tuner.tune([WORK])
    assert report.early == 0 and len(seen) == 1 and seen[0]


def test_stale_names_the_ops_whose_shipped_choices_todays_sources_retire(tmp_path):
    from kiln.tune import shipped
    key = {"format": tune_cache.FORMAT, "gpu": "G", "sources": {"gemm": "a", "moe": "b", "gone": "c"}}
    (tmp_path / "g_bf16.json").write_text(json.dumps({"key": key, "entries": {}}))
    (tmp_path / "broken_bf16.json").write_text("{")
    assert shipped.stale({"gemm": "a", "moe": "new"}, tmp_path) == {"g_bf16.json": ["gone", "moe"]}
    assert shipped.stale({"gemm": "a", "moe": "b", "gone": "c"}, tmp_path) == {"g_bf16.json": []}


def test_ship_tune_cover_counts_a_models_load_shapes_with_a_current_choice(tmp_path, capsys):
    """tools/ship_tune.py --cover: per op, how many of the shapes a load tunes a shipped file holds a
    choice for, an op whose kernel sources changed since counting none."""
    import importlib.util
    from pathlib import Path

    from kiln.backends.cuda import load_workloads
    from kiln.tune.cache import sources_hash
    from kiln.tune.registry import REGISTRY

    path = Path(__file__).parents[2] / "tools" / "ship_tune.py"
    spec = importlib.util.spec_from_file_location("ship_tune", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.cover({"gemm 1x2": {}, "moe 3": {}}, {"moe"}, ["gemm 1x2", "gemm 4x2", "moe 3"]) == {
        "gemm": (1, 2), "moe": (0, 1)}
    cls, cfg = model_config(synth_config("tiny-qwen3.5"))
    labels = [w.label for w in load_workloads(cls, cfg)]
    gemms = [x for x in labels if x.startswith("gemm ")]
    norms = [x for x in labels if x.startswith("rmsnorm ")]
    sources = dict(sources_hash(REGISTRY.values()), rmsnorm="changed")
    data = {"key": {"format": tune_cache.FORMAT, "gpu": "G", "sources": sources},
            "entries": {x: {"variant": "v", "ms": 1.0} for x in gemms[:2] + norms}}
    (tmp_path / "g_bf16.json").write_text(json.dumps(data))
    tool.show_cover(str(tmp_path / "g_bf16.json"), ["synth:tiny-qwen3.5"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("synth:tiny-qwen3.5: ")
    assert f"gemm 2/{len(gemms)}" in line and f"rmsnorm 0/{len(norms)} (retired)" in line


def test_shipped_pruning_keeps_what_came_near_a_best_and_holds_for_the_gpu_class(tmp_path):
    from kiln.tune import shipped
    key = {"format": tune_cache.FORMAT, "gpu": "G", "sms": 2, "capability": "9.0", "triton": "3", "dtype": "bf16",
           "sources": {"gemm": "a"}}
    one = {"key": key, "entries": {
        "gemm 1x8x8": {"variant": "v1", "ms": 0.1, "measured": {"v1": 0.1, "v2": 0.104, "v3": 0.2}},
        "gemm 64x8x8": {"variant": "v3", "ms": 0.3, "measured": {"v3": 0.3, "v4": 0.5}}}}
    made = shipped.merge([one], {"gemm": "a"})
    assert made["pruning"] == {"gemm": {"near": ["v1", "v2", "v3"], "seen": ["v1", "v2", "v3", "v4"]}}
    (tmp_path / "g_bf16.json").write_text(json.dumps(made))
    other = {**key, "gpu": "Another GPU", "sms": 114, "sources": {"gemm": "a", "rmsnorm": "x"}}
    assert shipped.never(other, tmp_path) == {"gemm": {"v4"}}
    assert shipped.never({**other, "capability": "8.0"}, tmp_path) == {}        # another class
    assert shipped.never({**other, "sources": {"gemm": "b"}}, tmp_path) == {}   # gemm's kernels changed
    # shipped again over the earlier file: its pruning carries over, a new choice joins "near"
    again = shipped.merge([made, {"key": key, "entries": {"gemm 1x8x8": {"variant": "v4", "ms": 0.05}}}],
                          {"gemm": "a"})
    assert again["pruning"]["gemm"] == {"near": ["v1", "v2", "v3", "v4"], "seen": ["v1", "v2", "v3", "v4"]}


def _measured_names(report) -> set[str]:
    return set(json.loads(report.path.read_text())["entries"][WORK.label]["measured"])


def test_a_cold_tune_skips_what_its_gpu_class_never_found_near_a_best(tmp_path, monkeypatch):
    """A shape without a shipped choice (an unknown GPU, a new model) measures the trusted and default
    variants and those the class's pruning kept; --retune measures every candidate."""
    chosen = _ship(tmp_path, monkeypatch)
    target = next((tmp_path / "shipped").glob("*.json"))
    made = json.loads(target.read_text())
    everything = {v.name for v in Tuner(DEVICE, DTYPE).candidates(WORK)}
    made["entries"] = {}
    made["pruning"] = {"gemm": {"near": [chosen], "seen": sorted(everything)}}
    target.write_text(json.dumps(made))
    kept = {gemm.OP.trusted(SHAPE, device_info(DEVICE)).name, gemm.OP.default(SHAPE, device_info(DEVICE)).name, chosen}
    _, report, _ = tune(tmp_path / "pruned")
    assert _measured_names(report) == kept and len(everything) > len(kept)
    _, report, _ = tune(tmp_path / "all", retune=True)
    assert _measured_names(report) == everything


def test_kiln_shipped_0_leaves_the_choices_out(tmp_path, monkeypatch):
    _ship(tmp_path, monkeypatch)
    monkeypatch.setenv("KILN_SHIPPED", "0")
    _, report, _ = tune(tmp_path / "cold")
    assert report.shipped == 0 and report.rows[0][3] == "measured"


def test_compile_workers_do_not_rerun_a_users_unguarded_script(tmp_path):
    """A user's script without `if __name__ == "__main__"` that loads a model: the spawned compile
    workers must not run it again (each would load the model)."""
    import subprocess
    import sys
    script = tmp_path / "user.py"
    script.write_text(
        "import sys, torch\n"
        "from kiln.ops.gemm import gemm\n"
        "from kiln.tune.cache import TuneCache\n"
        "from kiln.tune.tuner import Tuner, Workload\n"
        "print('MAIN RAN', flush=True)\n"
        "t = Tuner('cpu', torch.float32, cache=TuneCache(sys.argv[1]), budget_s=0, log=lambda line: None)\n"
        "t._workers = lambda jobs: 2 if jobs else 1\n"
        "w = Workload(gemm.OP, gemm.GemmShape(100, 100, 40))\n"
        "n = t.precompile([w])\n"
        "print('EARLY', n, t.tune([w])[1].early, flush=True)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "tune")], env=env, capture_output=True,
                         text=True, timeout=300).stdout
    assert out.count("MAIN RAN") == 1, out
    early = out.split("EARLY")[1].split()
    assert early[0] == early[1] and int(early[0]) > 0, out
