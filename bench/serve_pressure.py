"""kiln serve under page pressure, several times, each run a fresh server: did it stay up, how many
requests completed, how many preemptions, and, when the GPU failed, the server's last `[kiln]` lines
and (with --trace) the batch's last events (kiln/steptrace.py). The experiment of docs/batching.md's
"Fixed: a device-side assert" section, one call on the GPU machine:

    PYTHONPATH=. python3 bench/serve_pressure.py OUT.json --model synth:qwen3.5-9b --pages 250 \\
        --runs 4 --env KILN_INSIDE=none --trace

--pages N: a --gpu-memory budget leaving about N KV pages (bench/pool_budget.py's bisection; or give
--gpu-memory GB; neither: the server's default budget). Each run: `kiln serve MODEL --max-batch B
--gpu-memory G --max-context C`, then `kiln bench-serve URL --prompt-length P --gen G --concurrency
B` against it; runs stop starting past --budget-s. The JSON: the environment, the settings, each
run's outcome, its bench-serve JSON and log lines, and a summary line a run."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln.errors import KilnError  # noqa: E402
from kiln.tools.bench_serve import StartedServer  # noqa: E402

FAULT_MARKS = ("device-side assert", "srcIndex < srcSelectDimSize", "[kiln] fatal:", "illegal memory access")


def budget_for(model: str, pages: int, context: int, batch: int, dtype: str) -> float:
    """The --gpu-memory that bench/pool_budget.py prints for these settings (run here, in a process)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "pool_budget.py"), model, "--pages", str(pages),
                          "--max-context", str(context), "--max-batch", str(batch), "--dtype", dtype],
                         capture_output=True, text=True, check=True, env=_env({}))
    return float(out.stdout.strip().splitlines()[-1])


def _env(extra: dict) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_outcome(text: str) -> dict:
    """What a server's stderr says about a run: a fault or not, its first fault line, the [kiln] lines
    that came last (the captures before a fault), and the traceback's last frames."""
    lines = text.splitlines()
    fault = next((ln for ln in lines if any(m in ln for m in FAULT_MARKS)), None)
    kiln = [ln.strip()[:300] for ln in lines if ln.startswith("[kiln]")]
    trace = [ln for ln in lines if ln.startswith("  File ") or ln.startswith("torch.")]
    return {"fault": fault is not None, "first_fault_line": fault and fault[:300],
            "last_kiln_lines": kiln[-12:], "traceback_tail": trace[-8:]}


def trace_tail(path: Path, n: int) -> list[dict]:
    """The last n events of a KILN_TRACE file (empty when there is none)."""
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()[-n:]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:      # a line cut by the process's death
            break
    return out


def one_run(a, tag: str, gpu_memory: float | None, env: dict, work: Path) -> dict:
    trace = work / f"trace_{tag}.jsonl"
    env = dict(env, **({"KILN_TRACE": str(trace)} if a.trace else {}))
    flags = ["--dtype", a.dtype, "--max-batch", str(a.max_batch), "--max-context", str(a.max_context),
             "--queue-limit", str(a.max_batch)]
    if gpu_memory is not None:      # (none: the whole device, no page pressure unless the context is long)
        flags += ["--gpu-memory", f"{gpu_memory:.2f}"]
    t0 = time.monotonic()
    server = StartedServer(a.model, flags, None, env=_env(env))
    bench_json = work / f"bench_{tag}.json"
    bench = [sys.executable, "-m", "kiln.cli", "bench-serve", server.endpoint.url, "--prompt-length",
             str(a.prompt_length), "--gen", str(a.gen), "--concurrency", str(a.max_batch), "--json", str(bench_json)]
    run = {"tag": tag, "env": env_note(env), "serve": shlex.join(server.command[1:]),
           "bench_serve": shlex.join(bench[1:])}
    try:
        server.wait_ready(a.ready_timeout)
        run["ready"] = True
        done = subprocess.run(bench, capture_output=True, text=True, env=_env({}), timeout=a.run_timeout)
        run["bench_serve_rc"] = done.returncode
    except KilnError:
        run["ready"] = False
    except subprocess.TimeoutExpired:
        run["bench_serve_rc"] = "timeout"
    finally:
        server.stop(keep_log=True)
    log = Path(server.log.name)
    text = log.read_text(errors="replace")
    log.unlink()
    run["seconds"] = round(time.monotonic() - t0, 1)
    run.update(log_outcome(text))
    result = json.loads(bench_json.read_text()) if bench_json.exists() else None
    run["bench"] = result
    level = (result or {}).get("results", [{}])[0]
    run["completed"], run["failed"] = level.get("completed"), level.get("failed")
    run["output_tok_s"] = level.get("output_tok_s")
    run["preemptions"] = (level.get("server_counters") or {}).get("kiln_preemptions_total")
    if a.trace:
        run["trace_tail"] = trace_tail(trace, a.trace_events)
    return run


def write(report: dict, path: str) -> None:
    """The report with its summary, written to a temporary name and renamed."""
    report["summary"] = [{k: r.get(k) for k in ("tag", "env", "fault", "completed", "failed", "preemptions",
                                                "output_tok_s")} for r in report["runs"]]
    tmp_out = f"{path}.tmp"
    with open(tmp_out, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp_out, path)


def env_note(env: dict) -> str:
    keep = [(k, v) for k, v in sorted(env.items()) if k.startswith(("KILN_", "CUDA_")) and k != "KILN_TRACE"]
    return " ".join(f"{k}={v}" for k, v in keep)


def parse_env(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"serve_pressure: --env takes NAME=VALUE, got {pair!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="synth:qwen3.5-9b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--pages", type=int, help="a budget leaving about this many KV pages")
    p.add_argument("--gpu-memory", type=float, help="the budget itself, in GB (instead of --pages)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=64, help="also the concurrency and the queue limit")
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)")
    p.add_argument("--trace", action="store_true", help="KILN_TRACE on; the last --trace-events events kept")
    p.add_argument("--trace-events", type=int, default=300)
    p.add_argument("--budget-s", type=float, default=360,
                   help="start no run past this many seconds (default 360: a run takes about 2 minutes)")
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--run-timeout", type=float, default=180)
    a = p.parse_args(argv)
    if a.pages is not None and a.gpu_memory is not None:
        p.error("give --pages or --gpu-memory, not both")
    if a.runs < 1:
        p.error("--runs must be at least 1")
    env = parse_env(a.env)
    import torch

    from kiln.tools.benchutil import environment, now_iso
    start = time.monotonic()
    gpu_memory = a.gpu_memory if a.pages is None else budget_for(a.model, a.pages, a.max_context, a.max_batch, a.dtype)
    report = {"environment": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
              "date": now_iso(), "command": shlex.join(["python3", "bench/serve_pressure.py", *(argv or sys.argv[1:])]),
              "settings": {**vars(a), "gpu_memory": gpu_memory}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="kiln-pressure-") as tmp:
        for i in range(a.runs):
            if i and time.monotonic() - start > a.budget_s:
                break
            run = one_run(a, f"r{i}", gpu_memory, env, Path(tmp))
            report["runs"].append(run)
            print(f"[serve_pressure] {run['tag']}: fault={run['fault']} completed={run['completed']} "
                  f"failed={run['failed']} preemptions={run['preemptions']} tok/s={run['output_tok_s']} "
                  f"({run['seconds']} s)", file=sys.stderr, flush=True)
            write(report, a.out)        # after every run: a call cut by its time limit keeps the runs done
    faults = sum(r["fault"] for r in report["runs"])
    print(f"{faults} of {len(report['runs'])} runs faulted; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
