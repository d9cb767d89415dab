"""KILN_TRACE=FILE: one JSON line per host-side event of a batch (kiln.engine.Batch) and of its CUDA
graphs, appended to FILE as it happens (line-buffered: a process that dies leaves every line before
it). The order in which a serve launched its prefills and decode steps, took, grew and freed slots,
and captured graphs, for a fault that shows only with the GPU running asynchronously (the index
assert of docs/batching.md). Off by default; `event` is a no-op then.

Each line: {"t": seconds since the process imported this module, "e": the event, ...its fields}."""

from __future__ import annotations

import json
import os
import time

PATH = os.environ.get("KILN_TRACE") or None
_T0 = time.perf_counter()
_file = None


def event(kind: str, **fields) -> None:
    global _file
    if PATH is None:
        return
    if _file is None:
        _file = open(PATH, "a", buffering=1, encoding="utf-8")
    _file.write(json.dumps({"t": round(time.perf_counter() - _T0, 6), "e": kind, **fields}) + "\n")


def read(path: str) -> list[dict]:
    """The events of a trace file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
