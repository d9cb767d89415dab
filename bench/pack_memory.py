"""Peak memory and time of `kiln pack` on a synthesized model written as a bf16 HF folder.

    PYTHONPATH=. python3 bench/pack_memory.py OUT.json [--model qwen3.5-2b] [--layers 9] [--dir DIR]

Writes the folder (under DIR, default a temporary folder), packs it in a process of its own, and
reports the pack's peak RSS (VmHWM from /proc at its exit), its seconds and the bytes written; then
the same with the windowed copies switched off (every tensor loaded whole first), for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.models import synthesis
from kiln.tools.benchutil import command_line, environment, now_iso, write_atomic
from kiln.weights.synth import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CHILD = ("import sys\n"
         "import kiln.tools.pack as p\n"
         "from kiln.cli import main\n"
         "if sys.argv[3] == 'whole':\n"
         "    p.streamed = lambda *a: None\n"
         "rc = main(['pack', sys.argv[1], sys.argv[2], '--quiet'])\n"
         "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
         "sys.exit(rc)\n")


def pack_once(src: Path, out: Path, mode: str) -> dict:
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), mode], capture_output=True, text=True,
                         cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"pack failed: {run.stderr.strip()[-400:]}")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"mode": mode, "peak_rss_mb": round(int(run.stdout.strip().splitlines()[-1]) / 1024, 1),
            "seconds": round(time.perf_counter() - t0, 2), "bytes_written": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--model", default="qwen3.5-2b")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="kiln-pack-bench-"))
    try:
        drawn = synthesis(a.model, a.layers)
        src = write_checkpoint(drawn, work / "hf", a.model, dtype="bf16", quiet=True)
        runs = [pack_once(src, work / f"packed-{mode}", mode) for mode in ("windowed", "whole")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": "pack_memory", "model": f"synth:{a.model}:layers={a.layers}", "date": now_iso(),
              "command": command_line(), "environment": environment(torch.device("cpu")),
              "model_bytes_bf16": sum(math.prod(s) for s in drawn.shapes.values()) * 2, "runs": runs}
    write_atomic(a.json, lambda f: f.write(json.dumps(result, indent=2).encode()))
    for r in runs:
        print(f"{r['mode']}: peak RSS {r['peak_rss_mb']} MB, {r['seconds']} s, {r['bytes_written'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
