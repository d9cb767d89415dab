"""`kiln profile`: where the time of one prefill chunk and one decode step goes, op by op.

Every public method of the model's `ops` object is wrapped while profiling (models and backends
stay untouched: models call everything through `model.ops`). Time is exclusive: an op that calls
another op (`gated_mlp` -> `linear`) is charged only for its own work, so the op rows plus
"(outside ops)" (the model's glue between op calls) add up to the step's total. On CPU the clock is
perf_counter; on CUDA each call is bracketed by CUDA events read after one synchronize, so an op
whose kernels wait on the host shows that wait too.
"""

from __future__ import annotations

import inspect
import json
import sys
import time

import torch

from ..cli.flags import add_runtime_flags, at_least, load_from_flags
from ..errors import KilnError
from .bench import model_label, random_prompts
from .benchutil import (
    DTYPE_NAMES,
    check_writable,
    command_line,
    environment,
    markdown_table,
    now_iso,
    sync,
    write_atomic,
)

OUTSIDE = "(outside ops)"


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="time per op of one prefill chunk and one decode step")
    add_runtime_flags(p)
    p.add_argument("--prompt-length", type=at_least(1), default=512,
                   help="prompt tokens; the last prefill chunk of it is profiled (default 512)")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="profiled repeats after one warm-up; the mean is shown (default 3)")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the random-token prompt (default 0)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the profile as JSON")
    p.set_defaults(main=main)


class OpTimer:
    """Wraps every public method of `ops`; `step(fn)` runs fn and returns (total ms, {op: [calls, ms]})."""

    def __init__(self, ops, device: torch.device):
        self.ops, self.cuda = ops, device.type == "cuda"
        self.device = device
        self.names = [n for n, _ in inspect.getmembers(type(ops), inspect.isfunction) if not n.startswith("_")]
        self.records: list[list] = []  # [name, start mark, end mark, parent index or None]
        self.stack: list[int] = []

    def __enter__(self):
        self.saved = {n: vars(self.ops)[n] for n in self.names if n in vars(self.ops)}
        for n in self.names:
            setattr(self.ops, n, self._wrap(n, getattr(self.ops, n)))
        return self

    def __exit__(self, *exc):
        for n in self.names:
            delattr(self.ops, n)
        for n, fn in self.saved.items():
            setattr(self.ops, n, fn)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter_ns()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) / 1e6

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            rec = [name, self._mark(), None, self.stack[-1] if self.stack else None]
            self.stack.append(len(self.records))
            self.records.append(rec)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                rec[2] = self._mark()
        return timed

    def step(self, fn) -> tuple[float, dict[str, list]]:
        self.records, self.stack = [], []
        sync(self.device)
        start = self._mark()
        fn()
        end = self._mark()
        sync(self.device)
        inclusive = [self._ms(r[1], r[2]) for r in self.records]
        exclusive = list(inclusive)
        for r, t in zip(self.records, inclusive):
            if r[3] is not None:
                exclusive[r[3]] -= t
        per_op: dict[str, list] = {}
        for r, t in zip(self.records, exclusive):
            acc = per_op.setdefault(r[0], [0, 0.0])
            acc[0], acc[1] = acc[0] + 1, acc[1] + t
        return self._ms(start, end), per_op


def _profile_once(llm, timer: OpTimer, ids: list[int], start: int):
    """(prefill chunk, decode step) timings on fresh state; tokens before `start` are prefilled unprofiled."""
    eng, model = llm.engine, llm.model
    state = model.make_state(eng.dtype, eng.device)   # never the graph's state: ops run eagerly here
    if start:
        eng.prefill(ids[:start], state)
    chunk = torch.tensor(ids[start:], device=eng.device)
    pos = torch.arange(start, len(ids), device=eng.device)
    out = {}

    def prefill():
        out["logits"] = model.forward(chunk, pos, state)

    with torch.inference_mode():
        pre = timer.step(prefill)
    tok = int(torch.argmax(out["logits"][-1]))
    dec = timer.step(lambda: eng.decode_step(tok, len(ids), state))
    return pre, dec


def _mean(steps: list[tuple[float, dict]]) -> dict:
    """Mean over repeats of the total and each op; shares of the mean total, outside ops included."""
    n = len(steps)
    total = sum(t for t, _ in steps) / n
    ops: dict[str, list] = {}
    for _, per_op in steps:
        for name, (calls, ms) in per_op.items():
            acc = ops.setdefault(name, [0, 0.0])
            acc[0], acc[1] = acc[0] + calls, acc[1] + ms
    rows = [{"op": k, "calls": round(c / n), "ms": ms / n} for k, (c, ms) in ops.items()]
    rows.sort(key=lambda r: -r["ms"])
    rows.append({"op": OUTSIDE, "calls": 0, "ms": total - sum(r["ms"] for r in rows)})
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    return {"total_ms": total, "ops": rows}


def table(prof: dict) -> str:
    pre = {r["op"]: r for r in prof["prefill"]["ops"]}
    dec = {r["op"]: r for r in prof["decode"]["ops"]}
    names = [n for n in pre if n != OUTSIDE] + [n for n in dec if n not in pre and n != OUTSIDE] + [OUTSIDE]

    def cells(r, outside):
        if r is None:
            return ["0", "0.000", "0.0%"]
        return ["" if outside else str(r["calls"]), f"{r['ms']:.3f}", f"{100 * r['share']:.1f}%"]

    rows = [[n, *cells(pre.get(n), n == OUTSIDE), *cells(dec.get(n), n == OUTSIDE)] for n in names]
    rows.append(["total", "", f"{prof['prefill']['total_ms']:.3f}", "100.0%",
                 "", f"{prof['decode']['total_ms']:.3f}", "100.0%"])
    heads = ["op", "prefill calls", "prefill ms", "prefill share", "decode calls", "decode ms", "decode share"]
    return markdown_table(heads, rows, right=set(range(1, 7)))


def main(a) -> int:
    if a.json_path:
        check_writable(a.json_path, "--json")
    if a.max_context is not None and a.prompt_length + 1 > a.max_context:
        raise KilnError(f"prompt length {a.prompt_length} + 1 decode step does not fit --max-context {a.max_context}")
    llm = load_from_flags(a)
    eng, n = llm.engine, a.prompt_length
    if n + 1 > eng.max_context:
        raise KilnError(f"prompt length {n} + 1 decode step does not fit the max context of {eng.max_context} tokens")
    ids = random_prompts(llm.model.cfg.vocab_size, [n], a.seed)[n]
    start = (n - 1) // eng.prefill_chunk * eng.prefill_chunk  # the last prefill chunk is profiled
    with OpTimer(llm.model.ops, eng.device) as timer:
        _profile_once(llm, timer, ids, start)  # warm-up
        steps = [_profile_once(llm, timer, ids, start) for _ in range(a.repeats)]
    prof = {"engine": "kiln", "model": model_label(a.model, llm.path), "dtype": DTYPE_NAMES[eng.dtype],
            "backend": eng.model.ops.name, "device": str(eng.device), **environment(eng.device), "date": now_iso(),
            "command": command_line(), "prompt_tokens": n, "prefill_chunk": {"start": start, "tokens": n - start},
            "decode_position": n, "repeats": a.repeats, "clock": "cuda events" if timer.cuda else "perf_counter",
            "prefill": _mean([p for p, _ in steps]), "decode": _mean([d for _, d in steps])}
    print(table(prof), flush=True)
    if not a.quiet:
        print(f"[profile] {prof['model']} {eng.model.ops.name} {eng.device} {prof['dtype']}: "
              f"prefill chunk of {n - start} "
              f"tokens at positions {start}-{n - 1}, decode step at position {n}; exclusive time per op, "
              f"{prof['clock']}, mean of {a.repeats} after 1 warm-up", file=sys.stderr)
    if a.json_path:
        data = json.dumps(prof, indent=2).encode() + b"\n"
        write_atomic(a.json_path, lambda f: f.write(data))
    return 0
