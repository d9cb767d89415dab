"""`kiln bench`: prefill and decode tok/s per prompt length, optionally beside transformers or llama.cpp.

Protocol: the prompts are seeded random token ids (the prompt of n tokens is the first n of one
sequence), the same for every engine. Per prompt length each engine runs once unmeasured (warm-up),
then `--runs` measured times, the engines alternating which goes first; the median is reported.
Prefill is timed from the ids going in to the first generated token read on the host; decode from
there to the last of `--gen` tokens (greedy, never stopping at EOS), as a user waits for them.
The baseline (transformers, or llama.cpp through llama-cpp-python) runs in its own process
(`python -m kiln.tools.bench --worker`), driven one JSON line at a time over stdin/stdout, so each
engine has the machine to itself while it is measured and kiln's peak memory is kiln's alone.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import hub
from ..api import pick_device, resolve_model
from ..cli.flags import add_runtime_flags, at_least, load_from_flags, positive_int_list, save_expert_profile
from ..errors import KilnError
from . import llamacpp_baseline
from .benchutil import (
    DTYPE_NAMES,
    check_writable,
    command_line,
    disk_gb_s,
    environment,
    hbm_bytes_s,
    io_bound,
    link_gb_s,
    markdown_table,
    now_iso,
    page_cache_note,
    peak_mem_gb,
    process_start,
    quant_summary,
    reset_peak,
    resident_fraction,
    sync,
    token_bytes,
    write_atomic,
)
from .hf_reference import load_hf_reference

DEFAULT_LENGTHS = (512, 2048, 8192, 32768, 81920)
FIELDS = ("engine", "model", "dtype", "backend", "device", "gpu", "driver", "torch", "triton", "transformers",
          "kiln_commit", "kiln_env", "date", "command", "load_s", "load_stages", "first_token_s", "tune_s",
          "tune_cache", "peak_mem_gb", "state_bytes", "launches_per_token", "prefill_graphs", "quant",
          "bytes_per_token", "expert_store", "results", "baseline")


# -- flags -------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="prefill and decode tok/s per prompt length, optionally beside transformers "
                                     "or llama.cpp")
    add_runtime_flags(p)
    p.add_argument("--prompt-lengths", type=positive_int_list, default=None, metavar="N,N,...",
                   help="prompt lengths in tokens (default 512,2048,8192,32768,81920: those that fit the "
                        "model's context, and the longest prompt that does)")
    p.add_argument("--gen", type=at_least(2), default=128,
                   help="tokens generated after each prompt (default 128)")
    p.add_argument("--runs", type=at_least(1), default=2,
                   help="measured runs per length; the median is reported (default 2)")
    p.add_argument("--baseline", choices=["transformers", "llama.cpp"], default=None,
                   help="also run transformers, or llama.cpp on the same GGUF file (needs llama-cpp-python), "
                        "in its own process")
    p.add_argument("--baseline-attn", choices=["sdpa", "eager"], default="sdpa",
                   help="transformers attention implementation (default sdpa, its own default)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the random-token prompts (default 0)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot tok/s against prompt length (needs matplotlib)")
    p.set_defaults(main=main)


def _check_before_load(a) -> None:
    """Mistakes that would otherwise surface only after a long run: output folders, missing libraries."""
    if a.json_path:
        check_writable(a.json_path, "--json")
    if a.plot:
        if Path(a.plot).suffix.lower() != ".png":
            raise KilnError(f"--plot writes a PNG: give a file name ending in .png, got {a.plot!r}")
        if importlib.util.find_spec("matplotlib") is None:
            raise KilnError("--plot needs matplotlib (pip install 'kiln[bench]')")
        check_writable(a.plot, "--plot")
    if a.baseline == "transformers" and importlib.util.find_spec("transformers") is None:
        raise KilnError("--baseline transformers needs transformers (pip install 'kiln[test]')")
    if a.baseline == "llama.cpp":
        llamacpp_baseline.check_installed()


def fitted_defaults(limit: int, gen: int, say) -> list[int]:
    """The default prompt lengths that fit the max context with `gen` generated tokens; where some do
    not, the longest prompt that fits is added, and `say` tells which were dropped. Plain `kiln bench`
    should measure something on every model, not skip lengths a small model cannot hold."""
    fit = [n for n in DEFAULT_LENGTHS if n + gen <= limit]
    dropped = [n for n in DEFAULT_LENGTHS if n + gen > limit]
    longest = limit - gen
    if not dropped:
        return fit
    if longest < 1:
        raise KilnError(f"--gen {gen} leaves no room for a prompt in the max context of {limit} tokens")
    if longest not in fit:
        fit.append(longest)
    say(f"default prompt lengths {', '.join(map(str, dropped))} + --gen {gen} exceed the max context of "
        f"{limit} tokens: measuring {', '.join(map(str, fit))} ({longest}: the longest prompt that fits)")
    return fit


# -- measuring one engine -----------------------------------------------------------------------------
def _oom(e: BaseException) -> str | None:
    """The skip reason when `e` means the prompt did not fit in memory, else None."""
    text = str(e)
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return "out of memory: " + text.splitlines()[0][:200] if text else "out of memory"
    return None


def _free_cuda(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class KilnRunner:
    name = "kiln"

    def __init__(self, llm):
        self.llm = llm
        self.loaded_at = time.time()                # epoch seconds: the load is done
        self.first_prefill_s: float | None = None   # the first prefill's seconds, to its token
        self.state_bytes: int | None = None         # what the last run's per-layer state held (held_state_bytes)

    @torch.inference_mode()
    def _run(self, ids: list[int], gen: int) -> dict:
        eng = self.llm.engine
        state = eng.new_state(len(ids) + gen)
        sync(eng.device)
        t0 = time.perf_counter()
        tok = int(torch.argmax(eng.prefill(ids, state)))
        t1 = time.perf_counter()
        if self.first_prefill_s is None:
            self.first_prefill_s = t1 - t0
        tokens = [tok] + list(eng.greedy_tokens(tok, len(ids), state, gen - 1))   # as generate() runs greedy
        out = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": tokens}
        self.state_bytes = held_state_bytes(state)
        return out

    def measure(self, ids: list[int], gen: int) -> dict:
        try:
            return self._run(ids, gen)
        except KilnError as e:
            return {"skipped": str(e)}
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if (reason := _oom(e)) is None:
                raise
            _free_cuda(self.llm.engine.device)
            return {"skipped": reason}

    def close(self) -> None:
        self.llm = None
        gc.collect()


class Baseline:
    """transformers or llama.cpp on the same weights in a worker process; `measure` is one request to it.
    `n_threads` and `n_ctx` are llama.cpp's (kiln's torch thread count, the longest prompt + gen)."""

    def __init__(self, model: str, dtype: str, device: str, attn: str, engine: str = "transformers",
                 n_threads: int = 1, n_ctx: int = 512):
        self.name = engine
        self.err = tempfile.TemporaryFile(mode="w+")
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.tools.bench", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        self.version, self.n_threads, self.failed = None, None, None
        ready = self._ask({"engine": engine, "model": model, "dtype": dtype, "device": device, "attn": attn,
                           "n_threads": n_threads, "n_ctx": n_ctx})
        if "error" in ready:
            self.failed = f"{engine} could not run the model: {ready['error']}"
        else:
            self.version, self.load_s, self.n_threads = ready["version"], ready["load_s"], ready.get("n_threads")

    def _stderr_tail(self) -> str:
        self.err.seek(0)
        lines = [s.strip() for s in self.err.read().splitlines() if s.strip()]
        return lines[-1][:300] if lines else f"exit code {self.proc.poll()}"

    def _ask(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            return {"error": f"the worker exited ({self._stderr_tail()})"}
        return json.loads(line)

    def measure(self, ids: list[int], gen: int) -> dict:
        if self.failed:
            return {"skipped": self.failed}
        r = self._ask({"op": "measure", "ids": ids, "gen": gen})
        if "error" in r:
            self.failed = f"{self.name} failed: {r['error']}"
            return {"skipped": self.failed}
        return r

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.err.close()


# -- the protocol --------------------------------------------------------------------------------------
def random_prompts(vocab: int, lengths: list[int], seed: int) -> dict[int, list[int]]:
    """Prompt of n tokens = the first n ids of one seeded random sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (max(lengths),), generator=g).tolist()
    return {n: ids[:n] for n in lengths}


def run_protocol(runners, prompts: dict[int, list[int]], gen: int, runs: int, skips: dict[int, str],
                 log=lambda *a: None) -> dict[str, dict[int, list[dict]]]:
    """Per engine and prompt length: the measured runs, or a single {"skipped": reason}.
    Each length: one unmeasured warm-up per engine, then `runs` rounds, alternating who goes first."""
    out = {r.name: {} for r in runners}
    turn = 0
    for n, ids in prompts.items():
        live = []
        for r in runners:
            warm = {"skipped": skips[n]} if n in skips else r.measure(ids, gen)
            out[r.name][n] = [warm] if "skipped" in warm else []
            live += [] if "skipped" in warm else [r]
            log(r.name, n, "warm-up", warm)
        for i in range(runs if live else 0):
            for r in live if turn % 2 == 0 else live[::-1]:
                if out[r.name][n] and "skipped" in out[r.name][n][-1]:
                    continue
                m = r.measure(ids, gen)
                out[r.name][n] = [m] if "skipped" in m else out[r.name][n] + [m]
                log(r.name, n, f"run {i + 1}/{runs}", m)
            turn += 1
    return out


def summarise(n: int, runs: list[dict]) -> dict:
    """One results entry: medians over the runs, or the skip with its reason."""
    if not runs or "skipped" in runs[-1]:
        reason = runs[-1]["skipped"] if runs else "not measured"
        return {"prompt_tokens": n, "prefill_tok_s": None, "decode_tok_s": None, "gen_tokens": 0, "skipped": reason}
    gen = len(runs[0]["tokens"])
    prefill = statistics.median(n / m["prefill_s"] for m in runs)
    decode = statistics.median((gen - 1) / m["decode_s"] for m in runs)
    return {"prompt_tokens": n, "prefill_tok_s": round(prefill, 3), "decode_tok_s": round(decode, 3), "gen_tokens": gen}


def with_bound(entry: dict, report: dict) -> dict:
    """A measured entry with `decode_of_bound`: decode tok/s over the weight-bytes bound of this GPU
    (None where the repository has no measured bandwidth for it); a skipped entry as it is."""
    if "skipped" in entry:
        return entry
    bw = hbm_bytes_s(report.get("gpu")) if report["device"].startswith("cuda") else None
    tok_s = entry.get("decode_tok_s")
    entry["decode_of_bound"] = round(tok_s * report["bytes_per_token"] / bw, 4) if bw and tok_s else None
    return entry


def _log_line(quiet: bool):
    def log(engine, n, what, m):
        if quiet:
            return
        if "skipped" in m:
            print(f"[bench] {engine} {n} tok {what}: skipped ({m['skipped']})", file=sys.stderr)
        else:
            dec = (len(m["tokens"]) - 1) / m["decode_s"]
            print(f"[bench] {engine} {n} tok {what}: prefill {n / m['prefill_s']:,.1f} tok/s, "
                  f"decode {dec:,.1f} tok/s", file=sys.stderr)
    return log


# -- output ------------------------------------------------------------------------------------------
def _rate(x) -> str:
    return "skipped" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def _note(rows: dict[str, dict]) -> str:
    reasons = {name: r["skipped"] for name, r in rows.items() if r and "skipped" in r}
    if len(set(reasons.values())) == 1 and len(reasons) == len(rows):
        return next(iter(reasons.values()))
    return "; ".join(f"{name}: {why}" for name, why in reasons.items())


def table(report: dict) -> str:
    """The Markdown table: per prompt length kiln's tok/s, and the baseline's with the ratios."""
    base = report["baseline"]
    other = base["engine"] if base else None
    heads = ["prompt tokens", "gen tokens", "kiln prefill tok/s", "kiln decode tok/s"]
    if base:
        heads += [f"{other} prefill tok/s", f"{other} decode tok/s", f"prefill kiln/{other}", f"decode kiln/{other}"]
    by_len = {r["prompt_tokens"]: r for r in base["results"]} if base else {}
    rows = []
    for k in report["results"]:
        b = by_len.get(k["prompt_tokens"])
        gen = max(k["gen_tokens"], b["gen_tokens"] if b else 0)
        row = [str(k["prompt_tokens"]), str(gen) if gen else "-",
               _rate(k["prefill_tok_s"]), _rate(k["decode_tok_s"])]
        if base:
            row += [_rate(b["prefill_tok_s"]), _rate(b["decode_tok_s"]),
                    _ratio(k["prefill_tok_s"], b["prefill_tok_s"]), _ratio(k["decode_tok_s"], b["decode_tok_s"])]
        rows.append((row, _note({"kiln": k, other: b} if base else {"kiln": k})))
    if any(note for _, note in rows):
        heads.append("note")
        rows = [(row + [note], note) for row, note in rows]
    return markdown_table(heads, [row for row, _ in rows], right=set(range(8 if base else 4)))


def plot(path: str, report: dict, gen: int) -> None:
    """Prefill and decode tok/s against prompt length, log x axis, one line per engine."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    engines = [("kiln", report["results"])]
    if report["baseline"]:
        engines.append((report["baseline"]["engine"], report["baseline"]["results"]))
    lengths = [r["prompt_tokens"] for r in report["results"]]
    fig = Figure(figsize=(10, 4), dpi=120, layout="constrained")
    for ax, key, title in zip(fig.subplots(1, 2), ("prefill_tok_s", "decode_tok_s"),
                              ("prefill", f"decode ({gen} tokens after the prompt)")):
        for name, results in engines:
            pts = [(r["prompt_tokens"], r[key]) for r in results if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(title=title, xlabel="prompt tokens", ylabel="tok/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']} | {report['backend']} | {report['device']} ({report['gpu']}) | {report['dtype']}")
    write_atomic(path, lambda f: fig.savefig(f, format="png"))


def _agreement(measured: dict, engine: str, say) -> None:
    """Greedy tokens of kiln and the baseline from the same weights and prompt: a sanity check."""
    for n, runs in measured["kiln"].items():
        other = measured[engine].get(n) or [{}]
        a, b = (runs or [{}])[-1].get("tokens"), other[-1].get("tokens")
        if a and b:
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            say(f"greedy tokens at {n}: kiln and {engine} agree on the first {same} of {len(a)}")


# -- the command ---------------------------------------------------------------------------------------
def model_label(spec: str | None, path) -> str:
    if spec is None:
        return hub.DEFAULT_MODEL
    return spec if spec in hub.BUNDLED or spec.startswith("synth:") else str(path)


def _backend_fact(llm, name: str):
    """tune_s / tune_cache / launches_per_token as the backend reports them (None when it does not)."""
    for obj in (llm, llm.engine, llm.model.ops):
        if getattr(obj, name, None) is not None:
            return getattr(obj, name)
    return None


def held_state_bytes(state) -> int | None:
    """The bytes a request's per-layer state holds (its KV buffers, a window's ring, GDN states), each
    tensor once (a KV-shared layer reads its producer's); None without one."""
    if state is None:
        return None
    seen, total = set(), 0
    for layer in state:
        own = getattr(layer, "cache", getattr(layer, "producer", layer))
        own = getattr(own, "cache", own)
        for t in vars(own).values():
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
    return total


def _prefill_graphs(llm) -> dict | None:
    """The prefill graphs the runs captured (their row buckets), or None where they are off."""
    runner = getattr(llm.engine, "prefill_graphs", None)
    if runner is None:
        return None
    return {"captures": runner.captures, "replays": runner.replays, "failed": runner.failed,
            "buckets": sorted(key[0] for key in runner.graphs)}


def _gpu_fits_both(llm) -> bool:
    """Whether free GPU memory can hold transformers' copy of the weights beside kiln's."""
    dev = llm.engine.device
    if dev.type != "cuda":
        return True
    need = sum(t.numel() * t.element_size() for t in getattr(llm.model, "w", {}).values())
    free, _ = torch.cuda.mem_get_info(dev)
    return free > 1.25 * need + 4e9


def _load(a, say):
    synth = (a.model or "").startswith("synth:")
    # Resolving first pulls a missing bundled model, so load_s never includes a download.
    path = None if synth else resolve_model(a.model, quiet=a.quiet)
    if a.baseline == "llama.cpp":   # before kiln's load: a model llama.cpp cannot read ends the run at once
        llamacpp_baseline.check_gguf(a.model, path)
    cache = None if synth else resident_fraction(path)
    llm = load_from_flags(a)
    note = "weights synthesized, no checkpoint read" if synth else page_cache_note(cache)
    say(f"loaded {a.model or model_label(None, None)} ({DTYPE_NAMES[llm.engine.dtype]}, {llm.engine.device}, "
        f"{llm.model.ops.name}) in {llm.load_s:.2f} s; {note}")
    return llm


def main(a) -> int:
    _check_before_load(a)
    say = (lambda m: None) if a.quiet else (lambda m: print(f"[bench] {m}", file=sys.stderr))
    log = _log_line(a.quiet)
    reset_peak(pick_device(a.device))
    llm = _load(a, say)
    dev, gen = llm.engine.device, a.gen
    report = {"engine": "kiln", "model": model_label(a.model, llm.path), "dtype": DTYPE_NAMES[llm.engine.dtype],
              "backend": llm.model.ops.name, "device": str(dev), **environment(dev), "date": now_iso(),
              "command": command_line(), "load_s": round(llm.load_s, 3),
              "load_stages": llm.load_stages or None, "first_token_s": None, "tune_s": _backend_fact(llm, "tune_s"),
              "tune_cache": _backend_fact(llm, "tune_cache"), "peak_mem_gb": None, "state_bytes": None,
              "launches_per_token": _backend_fact(llm, "launches_per_token"), "prefill_graphs": None,
              "quant": quant_summary(llm.model),
              "bytes_per_token": token_bytes(llm.model), "expert_store": None}
    limit = llm.engine.max_context
    lengths = a.prompt_lengths or fitted_defaults(limit, gen, say)   # explicit lengths that do not fit are skipped
    prompts = random_prompts(llm.model.cfg.vocab_size, lengths, a.seed)
    skips = {n: f"prompt {n} + {gen} generated tokens exceed the max context of {limit} tokens"
             for n in prompts if n + gen > limit}
    start = _baseline_starter(a, llm, report, [n for n in prompts if n not in skips], say)
    kiln_runner, base = KilnRunner(llm), None
    together = a.baseline is not None and _gpu_fits_both(llm)
    if together:
        base = start()
    runners = [kiln_runner] + ([base] if together else [])
    try:
        measured = run_protocol(runners, prompts, gen, a.runs, skips, log)
        report["first_token_s"] = first_token_s(kiln_runner, report["load_stages"])
        report["peak_mem_gb"] = round(peak_mem_gb(dev), 3)
        report["state_bytes"] = kiln_runner.state_bytes
        report["launches_per_token"] = _backend_fact(llm, "launches_per_token")   # known once decode ran
        report["prefill_graphs"] = _prefill_graphs(llm)
        report["expert_store"] = _expert_store(llm)
        save_expert_profile(llm, a)
        if a.baseline is not None and not together:
            say(f"GPU memory cannot hold both engines: {a.baseline} runs after kiln, not alternating with it")
            kiln_runner.close()
            llm = None
            _free_cuda(dev)
            base = start()
            measured |= run_protocol([base], prompts, gen, a.runs, skips, log)
    finally:
        if base is not None:
            base.close()
    report["results"] = [with_bound(summarise(n, measured["kiln"][n]), report) for n in prompts]
    report["baseline"] = None if base is None else baseline_section(base, measured, prompts)
    return _finish(a, report, measured, say)


def _baseline_starter(a, llm, report: dict, lengths: list[int], say):
    """A function that starts the baseline's worker (called when it can run: beside kiln, or after it).
    llama.cpp gets kiln's torch thread count and a context for the longest measured prompt + --gen."""
    model = a.model if (a.model or "").startswith("synth:") else str(llm.path)
    threads, n_ctx = torch.get_num_threads(), max(lengths, default=1) + a.gen

    def start() -> Baseline:
        if a.baseline == "llama.cpp":
            say(f"starting llama.cpp (llama-cpp-python, {threads} threads) in a worker process")
        else:
            say(f"starting transformers ({a.baseline_attn}) in a worker process")
        return Baseline(model, report["dtype"], report["device"], a.baseline_attn, a.baseline, threads, n_ctx)
    return start


def baseline_section(base, measured: dict, prompts) -> dict:
    """The JSON's `baseline`: engine, version, llama.cpp's thread count, and results shaped as kiln's."""
    out = {"engine": base.name, "version": base.version}
    if base.name == llamacpp_baseline.NAME:
        out["n_threads"] = base.n_threads
    return out | {"results": [summarise(n, measured[base.name][n]) for n in prompts]}


def _expert_store(llm) -> dict | None:
    """The streamed experts' summary (every run, warm-ups too), with the --gpu-memory plan when one
    was given or chosen (`home` "resident" when the budget held every expert); None otherwise."""
    store, memory = getattr(llm.model, "expert_store", None), getattr(llm, "memory", None)
    out = None if store is None else store.summary()
    if out is not None:         # the rates its bytes move at, and the tok/s they allow
        out["rates_gb_s"] = {**link_gb_s(llm.engine.device), "disk": disk_gb_s(store)}
        out["io_bound_tok_s"] = io_bound(out, out["rates_gb_s"])
    if memory is not None:
        out = {**(out or {"home": "resident"}), "gpu_memory": memory.summary()}
    return out


def first_token_s(runner: "KilnRunner", stages: dict | None) -> float | None:
    """Seconds from this process's start to the end of the load, plus the first prefill to its token
    (the first warm-up's: any tuning or compiling a first prompt triggers is inside; a baseline's
    start, which comes between, is not), less the weights stage (reading the checkpoint is the
    disk's time, not kiln's): what a cold `kiln run` costs beyond the read."""
    start = process_start()
    if runner.first_prefill_s is None or start is None:
        return None
    return round(runner.loaded_at - start + runner.first_prefill_s - (stages or {}).get("weights", 0.0), 3)


def _finish(a, report: dict, measured: dict, say) -> int:
    print(table(report), flush=True)
    if report["baseline"]:
        _agreement(measured, report["baseline"]["engine"], say)
    fmt = lambda x, unit: "null" if x is None else f"{x}{unit}"  # noqa: E731
    mem = "peak GPU memory" if report["device"].startswith("cuda") else "peak RSS"
    stages = report.get("load_stages") or {}
    say(f"load {report['load_s']} s" + (f" ({', '.join(f'{k} {v} s' for k, v in stages.items())})" if stages else "")
        + f", first_token_s {fmt(report['first_token_s'], ' s')}"
        + f", tune {fmt(report['tune_s'], ' s')} (cache {fmt(report['tune_cache'], '')}), "
        f"{mem} {report['peak_mem_gb']} GB, launches/token {fmt(report['launches_per_token'], '')}")
    if a.json_path:
        data = json.dumps({k: report[k] for k in FIELDS}, indent=2).encode() + b"\n"
        write_atomic(a.json_path, lambda f: f.write(data))
        say(f"wrote {a.json_path}")
    if a.plot:
        plot(a.plot, report, a.gen)
        say(f"wrote {a.plot}")
    return 0


# -- the transformers worker (python -m kiln.tools.bench --worker) -------------------------------------------
@torch.inference_mode()
def _hf_run(model, ids: list[int], gen: int, device: torch.device, keep_kw: dict) -> dict:
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, **keep_kw)
    tok = int(out.logits[0, -1].argmax())
    t1 = time.perf_counter()
    tokens = [tok]
    for _ in range(gen - 1):
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=out.past_key_values, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
    return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": tokens}


def _hf_measure(model, req: dict, device: torch.device, keep_kw: dict) -> dict:
    try:
        return _hf_run(model, req["ids"], req["gen"], device, keep_kw)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if (reason := _oom(e)) is None:
            return {"error": _one_line(e)}
        _free_cuda(device)
        return {"skipped": reason}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _load_transformers(cfg: dict):
    """(ready facts, measure function) of transformers' model on the config's checkpoint."""
    import transformers

    device = torch.device(cfg["device"])
    model = load_hf_reference(cfg["model"], dtype=cfg["dtype"], device=cfg["device"], attn=cfg["attn"])
    keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return {"version": transformers.__version__}, lambda req: _hf_measure(model, req, device, keep_kw)


def _load_llamacpp(cfg: dict):
    ready, measure = llamacpp_baseline.load(cfg)

    def guarded(req: dict) -> dict:
        try:
            return measure(req)
        except Exception as e:  # a failed decode call: the parent skips the baseline with the reason
            return {"error": _one_line(e)}
    return ready, guarded


def worker_main() -> int:
    """Reads one config line, loads the baseline's model, then answers measure requests until quit."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    cfg = json.loads(sys.stdin.readline())
    loader = _load_llamacpp if cfg.get("engine") == llamacpp_baseline.NAME else _load_transformers
    try:
        t0 = time.perf_counter()
        ready, measure = loader(cfg)
        load_s = time.perf_counter() - t0
    except Exception as e:  # reported to the parent as the reason the baseline is skipped
        reply({"error": _one_line(e)})
        return 1
    reply({"ready": True, **ready, "load_s": load_s})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") != "measure":
            break
        reply(measure(req))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
