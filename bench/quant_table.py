"""docs/quant.md's table of quantisation error: each model quantised by `kiln quantize` at every bits x
group size, then `kiln compare QUANTISED --reference SOURCE` on the model's prompts (teacher-forced
top-1 agreement with the source's greedy tokens, mean KL(source || quantised) per token in nats).

    PYTHONPATH=. python3 bench/quant_table.py OUT.json [--models smollm2-135m,gemma3-270m]
        [--bits 2,3,4,5,6,8] [--groups 32,64,128] [--tokens 32]

Rows go into OUT.json as they are measured; a row already there (same --tokens) is not measured
again, so a long table can be stopped and taken up later. `--fill`: OUT.json exists (an earlier
run's, without the summaries): only kiln quantize runs again, deterministic, to add each row's
summary and bits per weight; then the table.

A model is a bundled name (its GGUF file is the source, dequantised at load: the quantised model is
that file's weights requantised), an HF folder, or a synth: spec (the quantised model is the spec
drawn with bits=B:group=G, which equals kiln quantize of the drawn model: tests/weights/test_synth.py;
random weights, so judge with care: docs/synth.md). A model PROMPTS does not name gets a random
64-token prompt.
Each pair runs as a new user would run it: the two CLI commands, in turn. The table (markdown) goes
to stdout, progress to stderr; the JSON holds every compare's summary.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kiln.fsutil import write_atomic
from kiln.tools.benchutil import environment, now_iso

# the prompts tests/models/test_real.py checks against transformers (one code, one not English)
PROMPTS = {
    "smollm2-135m": ["The capital of France is",
                     "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                     "La recette traditionnelle de la ratatouille comprend"],
    "gemma3-270m": ["The history of the Roman Empire begins", "import numpy as np\n\ndef softmax(x):\n",
                    "Die Hauptstadt von Deutschland ist"],
}
RANDOM = ["--random-prompt", "64"]


def kiln(*args: str) -> str:
    """A kiln command's stderr (its summary lines), or exit with them where it failed."""
    r = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"kiln {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stderr


def quantised_summary(stderr: str) -> tuple[str | None, float | None]:
    """kiln quantize's summary line and its bits per weight: a width that is not a multiple of the
    group keeps its module 16-bit (SmolLM2's 576 at group 128), so the bits say what was quantised."""
    line = next((s for s in stderr.splitlines() if s.startswith("kiln: quantised modules")), None)
    bpw = re.search(r"\(([\d.]+) bits per weight\)", line or "")
    return line, float(bpw.group(1)) if bpw else None


def measure(model: str, bits: int, group: int, tokens: int, work: Path) -> dict:
    work.mkdir()
    out, report = work / "quantised", work / "compare.json"
    summary, bpw = None, None
    if model.startswith("synth:"):
        quantised = f"{model}:bits={bits}:group={group}"
    else:
        summary, bpw = quantised_summary(kiln("quantize", model, str(out), "--bits", str(bits),
                                              "--group-size", str(group)))
        quantised = str(out)
    prompts = [a for p in PROMPTS[model] for a in ("--prompt", p)] if model in PROMPTS else RANDOM
    kiln("compare", quantised, "--reference", model, "--tokens", str(tokens), "--quiet", "--json", str(report),
         *prompts)
    runs = json.loads(report.read_text())["prompts"]
    agree = sum(r["teacher_forced"]["agree"] for r in runs)
    total = sum(len(r["reference_tokens"]) for r in runs)
    return {"model": model, "bits": bits, "group": group, "agree": agree, "tokens": total,
            "agreement": agree / total, "mean_kl": sum(r["mean_kl"] for r in runs) / len(runs),
            "identical": [r["identical"] for r in runs],
            "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")) or None,
            "bits_per_weight": bpw, "quantize": summary}


def cell(r: dict) -> str:
    """agreement, KL and (what was quantised: modules and the folder's MiB)"""
    what = re.search(r"modules: (\d+) at .*-> ([\d.]+ MiB)", r.get("quantize") or "")
    return f"{100 * r['agreement']:.1f}%, {r['mean_kl']:.4f}" + (f" ({what[1]}, {what[2]})" if what else "")


def table(rows: list[dict], groups: list[int]) -> str:
    lines = ["| model | bits | " + " | ".join(f"g{g}: agreement, KL (modules, size)" for g in groups) + " |",
             "|---|---|" + "---|" * len(groups)]
    for model in dict.fromkeys(r["model"] for r in rows):
        for bits in sorted({r["bits"] for r in rows if r["model"] == model}):
            cells = {r["group"]: r for r in rows if r["model"] == model and r["bits"] == bits}
            lines.append(f"| {model} | {bits} | " + " | ".join(cell(cells[g]) if g in cells else "" for g in groups)
                         + " |")
    return "\n".join(lines)


def fill(path: str, groups: list[int]) -> int:
    result = json.loads(Path(path).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(result["rows"]):
            if not r["model"].startswith("synth:"):
                out = Path(tmp, str(i))
                r["quantize"], r["bits_per_weight"] = quantised_summary(kiln(
                    "quantize", r["model"], str(out), "--bits", str(r["bits"]), "--group-size", str(r["group"])))
    result["filled"] = f"{now_iso()}: {' '.join(sys.argv)}"
    write_atomic(path, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(table(result["rows"], groups))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--bits", default="2,3,4,5,6,8")
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fill", action="store_true")
    a = ap.parse_args()
    bits, groups = [int(b) for b in a.bits.split(",")], [int(g) for g in a.groups.split(",")]
    if a.fill:
        return fill(a.out, groups)
    # written after every row, and rows already in OUT (same tokens) are kept: a long table can stop
    # and go on
    old = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    rows = old.get("rows", []) if old.get("tokens") == a.tokens else []
    done = {(r["model"], r["bits"], r["group"]) for r in rows}
    result = {"date": now_iso(), "command": " ".join(sys.argv), "tokens": a.tokens, "rows": rows,
              **environment(torch.device("cpu"))}
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models.split(","):
            for b in bits:
                for g in groups:
                    if (model, b, g) in done:
                        continue
                    rows.append(measure(model, b, g, a.tokens, Path(tmp, str(len(rows)))))
                    r = rows[-1]
                    print(f"{model} {b}-bit g{g}: agreement {r['agreement']:.3f}, mean KL {r['mean_kl']:.4f}",
                          file=sys.stderr, flush=True)
                    write_atomic(a.out, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(table(rows, groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
