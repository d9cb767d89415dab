"""The tuner: for each (op, shape) the model runs, compile every candidate (in worker processes on
a GPU), gate each against the trusted variant, time the survivors, keep the fastest, and cache
the choice. Log lines on stderr (tests and users grep them):

  [autotune] OP SHAPE: wrong against trusted, never picked: VARIANT (max err E of M)
  [autotune] OP SHAPE: V1 0.031 ms, V2* 0.027 ms, V3 0.040 ms -> V2
  [kiln] N kernels compiled in X s, tuned in Y s (cache miss: PATH)   (or cache hit)
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
import types
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import KilnError
from . import gate, shipped, timing
from .cache import DTYPE_NAMES, TuneCache, make_key
from .device import device_info
from .gate import fault_error
from .registry import Op, Variant, candidates, catalogue, get_op

DEFAULT_BUDGET_S = 600.0   # measuring stops here; what is left takes each op's default
SAVE_EVERY_S = 15.0        # a long tune saves what it has measured this often: a killed one keeps it
ORDER = {"rmsnorm": 0, "gemm": 1, "rmsnorm_gemm": 2}   # composite variants read earlier choices


@dataclass(frozen=True)
class Workload:
    op: Op
    shape: object

    @property
    def label(self) -> str:
        return f"{self.op.name} {self.op.shape_str(self.shape)}"


class Plan:
    """The chosen variant of each measured (op, shape); other row counts take the choice of the
    nearest measured one at or above them (else the largest, unless only one row was measured),
    unmeasured shapes the op's default."""

    def __init__(self, dev, dtype: torch.dtype):
        self.dev, self.dtype = dev, dtype
        self.choices: dict[str, Variant] = {}
        self.rows: dict[tuple, list[tuple[int, Variant]]] = {}
        self.times: dict[str, float | None] = {}

    def set(self, w: Workload, v: Variant, ms: float | None = None) -> None:
        self.choices[w.label] = v
        self.times[w.label] = ms
        bucket = self.rows.setdefault((w.op.name, w.shape.key), [])
        bucket[:] = sorted([(r, x) for r, x in bucket if r != w.shape.rows] + [(w.shape.rows, v)], key=lambda t: t[0])

    def choose(self, op: Op, shape) -> Variant:
        bucket = self.rows.get((op.name, shape.key))
        if not bucket or bucket[-1][0] == 1 < shape.rows:   # a one-row form (a GEMV) would re-read per row
            return op.default(shape, self.dev)
        return next((v for r, v in bucket if r >= shape.rows), bucket[-1][1])


@dataclass
class Report:
    compiled: int = 0
    compile_s: float = 0.0
    tune_s: float = 0.0
    hit: bool = False
    path: Path | None = None
    shipped: int = 0            # choices taken from kiln's shipped ones (gated, not timed)
    early: int = 0              # kernels compiled by precompile, while the weights loaded
    rows: list = field(default_factory=list)   # (label, variant name, ms or None, how)

    def summary(self) -> str:
        state = "hit" if self.hit else "miss"
        ship = f"; {self.shipped} shipped choices gated, not timed" if self.shipped else ""
        ship += f"; {self.early} compiled while the weights loaded" if self.early else ""
        return (f"[kiln] {self.compiled} kernels compiled in {self.compile_s:.1f} s, tuned in {self.tune_s:.1f} s "
                f"(cache {state}: {self.path}{ship})")


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms >= 0.01 else f"{ms:.4f}"


class Tuner:
    def __init__(self, device, dtype: torch.dtype, *, cache: TuneCache | None = None, retune: bool = False,
                 pins: dict[str, str] | None = None, budget_s: float | None = None, quiet: bool = False,
                 reps: int | None = None, workers: int | None = None, log: Callable[[str], None] | None = None):
        self.device = torch.device(device)
        self.dev = device_info(self.device)
        if self.device.type == "cuda":   # the context exists before the stage is timed (a load has moved weights)
            torch.empty(1, device=self.device)
        self.dtype, self.retune, self.pins = dtype, retune, dict(pins or {})
        for op in self.pins:     # an unknown op is a user mistake: say which ops there are
            get_op(op)
        if budget_s is None:   # KILN_TUNE_BUDGET_S: e.g. 0 in CPU tests, where only the numbers matter
            budget_s = float(os.environ.get("KILN_TUNE_BUDGET_S", DEFAULT_BUDGET_S))
        self.budget_s = budget_s
        self.reps = reps if reps is not None else (None if self.device.type == "cuda" else 1)
        self.workers = workers
        self.log = log or ((lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True)))
        self.cache = cache if cache is not None else TuneCache(warn=self.log)
        self._pool, self._early = None, {}       # precompile's worker pool and its jobs
        self._pool_lock = threading.Lock()       # its shutdowns, one at a time (concurrent ones race in CPython)
        self.never: dict[str, set[str]] = {}     # variants this GPU class does not measure (_split sets it)

    # -- the whole flow ------------------------------------------------------------------------
    def tune(self, workloads: list[Workload]) -> tuple[Plan, Report]:
        workloads = sorted(dict.fromkeys(workloads), key=lambda w: ORDER.get(w.op.name, 9))
        plan, report = Plan(self.dev, self.dtype), Report()
        key, entries, borrowed, pinned, cached, ships, ship, todo = self._split(workloads)
        report.path = self.cache.path(key)
        if n := sum(not e.get("gated") for e in borrowed.values()):
            self.log(f"[kiln] {n} choices from other models' tune caches with the same GPU, "
                     f"versions and kernels")
        report.hit = not todo and not ship

        t0, report.early = time.perf_counter(), len(self._early)
        measure_jobs, load_jobs = self.compile_jobs(todo, cached, pinned, ship)
        failed = self.compile_all(measure_jobs, parallel=True)
        failed.update(self.compile_all({k: j for k, j in load_jobs.items() if k not in measure_jobs}, parallel=False))
        report.compiled, report.compile_s = len(measure_jobs.keys() | load_jobs.keys()), time.perf_counter() - t0

        t0 = saved = time.perf_counter()
        labels = {w.label for w in workloads}
        how = {}
        for w, v in cached.items():
            plan.set(w, v, entries[w.label].get("ms"))
            how[w] = "cached"
        todo_set, retried = set(todo), 0
        for w in [w for w in workloads if w in ship or w in todo_set]:   # in ORDER: composites read earlier choices
            try:
                v = ship.get(w)
                if v is not None:       # a shipped choice is gated, not timed; a wrong one is measured
                    if failed.get((w.op.name, w.shape.key, v.name)) is None and self.gated(w, v, plan):
                        ms = ships[w.label].get("ms")
                        plan.set(w, v, ms)
                        entries[w.label], how[w] = {"variant": v.name, "ms": ms, "shipped": True}, "shipped"
                        continue
                    retried += 1
                    jobs = self.compile_jobs([w], {}, {}, {})[0]
                    failed.update(self.compile_all({k: j for k, j in jobs.items() if k not in measure_jobs},
                                                   parallel=True))
                spent = time.perf_counter() - t0 + report.compile_s
                entry = self.measure(w, plan, failed, over_budget=spent > self.budget_s)
                entries[w.label] = entry
                how[w] = "default" if entry.get("gated") else "measured"
            except torch.cuda.OutOfMemoryError:
                how[w] = self.too_large(w, plan, entries)
            if time.perf_counter() - saved > SAVE_EVERY_S:
                self.cache.save(key, {k: e for k, e in entries.items() if k in labels})
                saved = time.perf_counter()
        report.shipped = len(ship) - retried
        for w, v in pinned.items():
            self.use_pinned(w, v, plan)
            how[w] = "pinned"
        report.rows = [(w.label, plan.choices[w.label].name, plan.times.get(w.label), how[w]) for w in workloads]
        report.tune_s = time.perf_counter() - t0
        if todo or borrowed or ship:
            report.path = self.cache.save(key, {k: e for k, e in entries.items() if k in labels})
        self.log(report.summary())
        return plan, report

    def _split(self, workloads: list[Workload]):
        """What tune(workloads) does with each: the cache key, the cache's entries (borrowed ones
        added), the pinned, cached and shipped choices (with the shipped entries), and the rest to
        measure."""
        key = make_key(self.dev, self.dtype, {w.op for w in workloads}, [w.label for w in workloads])
        self.never = {} if self.retune else shipped.never(key)
        entries = {} if self.retune else (self.cache.load(key) or {})
        missing = set() if self.retune else {w.label for w in workloads
                                             if w.label not in entries or entries[w.label].get("gated")}
        borrowed = self.cache.borrow(key, missing) if missing else {}
        entries.update(borrowed)
        pinned = {w: self.pinned(w) for w in workloads if w.op.name in self.pins}
        cached = {w: v for w in workloads if w not in pinned and (v := self.cached(w, entries)) is not None}
        left = {w.label for w in workloads if w not in pinned and w not in cached}
        ships = {} if self.retune else shipped.lookup(key, left)
        ship = {w: v for w in workloads if w.label in left and (v := self.cached(w, ships)) is not None}
        if self.budget_s <= 0:      # measures nothing: a default gated before is taken again as it is
            cached.update({w: v for w in workloads if w.label in left and w not in ship
                           and (v := self.cached(w, entries, gated=True)) is not None})
        todo = [w for w in workloads if w.label in left and w not in ship and w not in cached]
        return key, entries, borrowed, pinned, cached, ships, ship, todo

    def precompile(self, workloads: list[Workload]) -> int:
        """Start compiling, in worker processes, the kernels tune(workloads) would compile there, and
        return at once (how many): a load calls this before its weights, so that a cold start's
        compiling runs while they are read. tune() then waits for these instead of compiling them."""
        workloads = sorted(dict.fromkeys(workloads), key=lambda w: ORDER.get(w.op.name, 9))
        _, _, _, pinned, cached, _, ship, todo = self._split(workloads)
        work = {k: j for k, j in self.compile_jobs(todo, cached, pinned, ship)[0].items() if j[2].run is None}
        workers = self._workers(len(work))
        if workers <= 1:
            return 0
        try:
            self._pool, self._early = self._start(work, workers)
        except Exception as e:  # noqa: BLE001  (no worker processes here: tune() compiles as before)
            self.log(f"[kiln] warning: early compile not started ({type(e).__name__}: {e})")
            self._early = {}
            return 0
        # the workers exit once every job is done: each holds a CUDA context (0.5-2.7 GB measured on
        # the H200) that a load filling the GPU (the 397B's, weights drawn for minutes) needs back
        pool, futures = self._pool, list(self._early)
        threading.Thread(target=lambda: (wait(futures), self._shutdown(pool, wait=True)), daemon=True).start()
        return len(work)

    def _collect_early(self) -> tuple[set, dict[tuple, str]]:
        """Wait for precompile's jobs: (the keys they covered, the ones that failed with why). A pool
        that broke covers nothing (tune() compiles those itself)."""
        early, self._early = self._early, {}
        if not early:
            return set(), {}
        failed = {}
        try:
            for f in as_completed(early):
                if err := f.result():
                    failed[early[f]] = err
        except Exception as e:  # noqa: BLE001
            self.log(f"[kiln] warning: early compile failed ({type(e).__name__}: {e}); compiling again")
            return set(), {}
        finally:
            self._shutdown(self._pool, wait=True)
        return set(early.values()), failed

    def cancel(self) -> None:
        """Drop precompile's jobs: queued ones cancelled, running ones finish in their workers."""
        if self._early:
            self._early = {}
            self._shutdown(self._pool, wait=False, cancel_futures=True)

    def _shutdown(self, pool: ProcessPoolExecutor, **how) -> None:
        """pool.shutdown(**how) under a lock: precompile's thread and tune() or cancel() may both shut it
        down, and two concurrent shutdowns of a ProcessPoolExecutor race on its fields (one sets
        them to None while the other uses them)."""
        with self._pool_lock:
            pool.shutdown(**how)

    def _workers(self, jobs: int) -> int:
        """Worker processes for `jobs` compile jobs: none off the GPU or for fewer than 8."""
        workers = self.workers
        if workers is None:
            workers = int(os.environ.get("KILN_COMPILE_WORKERS", os.cpu_count() or 1))
        if self.device.type != "cuda" or jobs < 8:
            return 1
        return max(1, min(workers, jobs, 32))

    # -- choosing what to run --------------------------------------------------------------------
    def pinned(self, w: Workload) -> Variant:
        name = self.pins[w.op.name]
        forms = catalogue(w.op, w.shape, self.dev) + [w.op.trusted(w.shape, self.dev)]
        for v in forms:
            if v.name == name:
                return v
        names = ", ".join(dict.fromkeys(v.name for v in forms))
        raise KilnError(f"--tune {w.op.name}={name}: no such variant for {w.label} (available: {names})")

    def cached(self, w: Workload, entries: dict, gated: bool = False) -> Variant | None:
        """The entry's variant: a measured (or shipped) choice, or with `gated` a default chosen when a
        budget was spent (a load that measures nothing takes it again, its gate not run again)."""
        e = entries.get(w.label)
        if e is None or bool(e.get("gated")) != gated:
            return None
        return next((v for v in catalogue(w.op, w.shape, self.dev) if v.name == e["variant"]), None)

    def candidates(self, w: Workload) -> list[Variant]:
        """The trusted variant and the op's candidates, less those this GPU class never found near a
        shape's best (kiln.tune.shipped.never; all of them under --retune)."""
        trusted, default = w.op.trusted(w.shape, self.dev), w.op.default(w.shape, self.dev)
        never = set() if self.retune else self.never.get(w.op.name, set())
        forms = [v for v in candidates(w.op, w.shape, self.dev) if v.name not in never or v == default]
        return list(dict.fromkeys([trusted] + forms))

    # -- compiling -----------------------------------------------------------------------------------
    def compile_jobs(self, todo, cached, pinned, ship) -> tuple[dict, dict]:
        """Unique (op, compile-time shape, variant) -> (op, shape, variant), rows left out: the
        candidates of what is measured and the shipped choices with their trusted variants (compiled
        in workers: on a cold start nothing of theirs is in Triton's cache), and the choices that
        are only loaded (cached, pinned)."""
        def unique(pairs):
            jobs = {}
            for w, v in pairs:
                jobs.setdefault((w.op.name, w.shape.key, v.name), (w.op, w.shape, v))
            return jobs
        load = [(w, v) for w, v in cached.items()] + [(w, v) for w, v in pinned.items()]
        load += [(w, w.op.trusted(w.shape, self.dev)) for w in pinned]
        measure = [(w, v) for w in todo for v in self.candidates(w)]
        measure += [(w, x) for w, v in ship.items() for x in (v, w.op.trusted(w.shape, self.dev))]
        return unique(measure), unique(load)

    def compile_all(self, jobs: dict, parallel: bool) -> dict[tuple, str]:
        """Compile every job; returns the ones that failed, with why. To measure on a GPU, worker
        processes compile in parallel into Triton's on-disk cache, which this process then loads
        from; choices read from the tune cache are loaded here (no workers to start)."""
        failed: dict[tuple, str] = {}
        work = {k: j for k, j in jobs.items() if j[2].run is None}
        if parallel:
            done, failed = self._collect_early()   # precompile's jobs, compiled while the weights loaded
            rest = {k: j for k, j in work.items() if k not in done}
            if (workers := self._workers(len(rest))) > 1:
                failed.update(self.compile_in_workers(rest, workers))
        for k, (op, shape, v) in work.items():
            if k in failed:
                continue
            try:
                self.trace(op.name, v, "compile")
                op.compile(v, shape, self.dtype, self.device)
                self.trace(op.name, v, "compiled", sync=True)
            except Exception as e:  # noqa: BLE001  (a variant that cannot build is rejected, not fatal)
                if (err := fault_error(e, op.name, v.name)) is not None:
                    raise err from e
                failed[k] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        return failed

    def compile_in_workers(self, work: dict, workers: int) -> dict[tuple, str]:
        failed = {}
        try:
            pool, futures = self._start(work, workers)
            with pool:
                for f in as_completed(futures):
                    err = f.result()
                    if err:
                        failed[futures[f]] = err
        except Exception as e:  # noqa: BLE001  (no worker processes here: compile in this one)
            self.log(f"[kiln] warning: parallel compile failed ({type(e).__name__}: {e}); compiling serially")
            return {}
        return failed

    def _start(self, work: dict, workers: int) -> tuple[ProcessPoolExecutor, dict]:
        """A pool of spawned workers with every job of `work` submitted: (pool, future -> key)."""
        import multiprocessing
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        dtype = DTYPE_NAMES[self.dtype]
        with bare_main():       # the workers start inside submit
            futures = {pool.submit(compile_job, op, shape, v.name, dtype, str(self.device)): k
                       for k, (op, shape, v) in work.items()}
        return pool, futures

    # -- gate and measure ------------------------------------------------------------------------
    def too_large(self, w: Workload, plan: Plan, entries: dict) -> str:
        """A workload whose tuning inputs do not fit beside the weights (the 397B's expert stacks drawn
        whole in f32: 16 GiB): its default form, unmeasured and not cached (a roomier run measures it).
        The model's own path checks what fits as well, and for such shapes rarely runs this op."""
        v = w.op.default(w.shape, self.dev)
        plan.set(w, v, None)
        entries.pop(w.label, None)
        free = ""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free = f" ({torch.cuda.mem_get_info(self.device)[0] / 1e9:.1f} GB free)"
        self.log(f"[kiln] {w.label}: its tuning inputs do not fit in the GPU memory left{free}: "
                 f"{v.name}, not measured")
        return "default"

    def measure(self, w: Workload, plan: Plan, failed: dict, over_budget: bool) -> dict:
        op, shape, label = w.op, w.shape, w.label
        trusted = op.trusted(shape, self.dev)
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(label.encode()))
        cases = gate.trusted_cases(op, shape, trusted, self.dtype, self.device, gen, plan)
        forms = [op.default(shape, self.dev)] if over_budget else self.candidates(w)
        survivors = []
        for v in forms:
            why = failed.get((op.name, shape.key, v.name))
            self.trace(op.name, v, f"gate {label}")
            verdict = gate.Verdict(False, math.nan, 0.0, why) if why else gate.check(op, v, cases, plan)
            self.trace(op.name, v, "gated", sync=True)
            if verdict.ok:
                survivors.append(v)
            elif verdict.reason:
                self.log(f"[autotune] {label}: cannot run, never picked: {v.name} ({verdict.reason})")
            else:
                self.log(f"[autotune] {label}: wrong against trusted, never picked: {v.name} "
                         f"(max err {verdict.err:.1e} of {verdict.scale:.1e})")
        if not survivors:
            survivors = [trusted]
        if over_budget:
            chosen = survivors[0]
            self.log(f"[autotune] {label}: tuning budget of {self.budget_s:.0f} s spent, not measured -> {chosen.name}")
            plan.set(w, chosen)
            return {"variant": chosen.name, "gated": True}
        del cases
        times = self.time_all(w, survivors, plan)
        best = min(times, key=times.get)
        self.log(f"[autotune] {label}: " + ", ".join(f"{v.name}{'*' if v == best else ''} {fmt_ms(t)} ms"
                                                     for v, t in times.items()) + f" -> {best.name}")
        plan.set(w, best, times[best])
        return {"variant": best.name, "ms": round(times[best], 6),
                "measured": {v.name: round(t, 6) for v, t in times.items()}}

    def time_all(self, w: Workload, forms: list[Variant], plan: Plan) -> dict[Variant, float]:
        op, shape = w.op, w.shape
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(w.label.encode()) + 1)
        first = op.inputs(shape, self.dtype, self.device, gen)
        out = op.outputs(shape, first)
        n = timing.set_count(timing.nbytes(first) + timing.nbytes(out), self.device)
        sets = [(first, out)] + [(i := op.inputs(shape, self.dtype, self.device, gen), op.outputs(shape, i))
                                 for _ in range(n - 1)]
        times = {}
        for v in forms:
            runs = [lambda i=i, o=o, v=v: op.run(v, i, o, plan) for i, o in sets]
            self.trace(op.name, v, f"time {w.label}")
            times[v] = timing.time_ms(runs, self.device, self.reps)
            self.trace(op.name, v, "timed", sync=True)
        return times

    def trace(self, op: str, v: Variant, stage: str, sync: bool = False) -> None:
        """KILN_TUNE_TRACE=1: a line before and after each variant's compile and gate, synchronised,
        so that a variant that faults (and kills the process) is the last one named: skip it with
        KILN_TUNE_SKIP=op=variant."""
        if os.environ.get("KILN_TUNE_TRACE", "0") in ("", "0"):
            return
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        print(f"[autotune] trace {stage}: {op}={v.name}", file=sys.stderr, flush=True)

    def use_pinned(self, w: Workload, v: Variant, plan: Plan) -> None:
        """A pinned variant is not measured, but it is still gated: a wrong one is never run."""
        if not self.gated(w, v, plan):
            v = w.op.trusted(w.shape, self.dev)
        self.log(f"[autotune] {w.label}: pinned -> {v.name}")
        plan.set(w, v)

    def gated(self, w: Workload, v: Variant, plan: Plan) -> bool:
        """Whether v passes the correctness gate against the trusted variant (logged when not)."""
        gen = torch.Generator(device=self.device).manual_seed(zlib.crc32(w.label.encode()))
        trusted = w.op.trusted(w.shape, self.dev)
        cases = gate.trusted_cases(w.op, w.shape, trusted, self.dtype, self.device, gen, plan)
        verdict = gate.check(w.op, v, cases, plan)
        if not verdict.ok:
            self.log(f"[autotune] {w.label}: wrong against trusted, never picked: {v.name} "
                     f"(max err {verdict.err:.1e} of {verdict.scale:.1e})" if not verdict.reason else
                     f"[autotune] {w.label}: cannot run, never picked: {v.name} ({verdict.reason})")
        return verdict.ok


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """While worker processes are spawned, __main__ is a bare module: a spawned worker otherwise
    re-runs the parent's main script, all of it when the script has no `if __name__ == "__main__"`
    guard (a user's script calling kiln.load would load the model again in every worker). The
    workers need only kiln's modules."""
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


def warm_launcher(kernel) -> None:
    """Load a compiled kernel here, which builds its launcher (a C stub Triton compiles with the
    system's compiler, ~0.3 s each, cached on disk beside the kernel): done in a worker, the loading
    process's first launch finds it built. Best effort: a Triton without this hook skips it."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        try:
            init()
        except Exception:  # noqa: BLE001  (the loading process builds it then)
            pass


def compile_job(op: Op, shape, variant_name: str, dtype: str, device: str) -> str | None:
    """Runs in a worker process (the op arrives pickled, its module imported there): compile one
    variant into Triton's on-disk cache. Returns why it failed, or None."""
    try:
        dt = {v: k for k, v in DTYPE_NAMES.items()}[dtype]
        dev = device_info(device)
        v = next(v for v in op.catalogue(shape, dev) + [op.trusted(shape, dev)] if v.name == variant_name)
        for kernel in op.compile(v, shape, dt, torch.device(device)) or []:
            warm_launcher(kernel)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()    # the stand-in tensors' memory back to the driver (the LM head's: 0.5 GB)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
