"""Timing a variant: CUDA events around replays of a CUDA graph that runs the variant once on each
of several input sets (rotated so that together they exceed L2: each run reads from DRAM, as in
the model), after a warm-up; the median over replays. On CPU (the interpreter) a wall clock:
every step runs, the numbers mean nothing.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

TARGET_MS = 20.0      # measure about this long per variant
MIN_REPS, MAX_REPS = 5, 100
MAX_SETS = 64


def l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 << 20)


def set_count(set_bytes: int, device: torch.device) -> int:
    """How many input sets to rotate through: together at least twice the L2."""
    if device.type != "cuda":
        return 1
    return max(2, min(MAX_SETS, math.ceil(2 * l2_bytes(device) / max(set_bytes, 1))))


def nbytes(d: dict) -> int:
    """The bytes of an input set: its tensors and its quantised weights (their `nbytes`)."""
    return sum(t.nbytes for t in d.values() if isinstance(getattr(t, "nbytes", None), int))


def time_ms(runs: list[Callable[[], None]], device: torch.device, reps: int | None = None) -> float:
    """Median milliseconds of one call, the calls in `runs` taken in rotation."""
    if device.type != "cuda":
        return _wall_ms(runs, reps or 2)
    try:
        return _graph_ms(runs, device, reps)
    except RuntimeError:  # some launch cannot be captured: time it eagerly
        torch.cuda.synchronize(device)
        return _events_ms(runs, device, reps)


def _wall_ms(runs, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for run in runs:
            run()
        samples.append((time.perf_counter() - t0) * 1e3 / len(runs))
    return statistics.median(samples)


def _replays(replay: Callable[[], None], device, reps: int | None, per: int) -> float:
    replay()                                          # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    torch.cuda.synchronize(device)
    once = max(start.elapsed_time(end), 1e-3)
    n = reps or max(MIN_REPS, min(MAX_REPS, int(TARGET_MS / once)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in events:
        a.record()
        replay()
        b.record()
    torch.cuda.synchronize(device)
    return statistics.median(a.elapsed_time(b) for a, b in events) / per


def _graph_ms(runs, device, reps) -> float:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):                    # warm on a side stream before capture
        for run in runs:
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    try:
        return _replays(graph.replay, device, reps, len(runs))
    finally:
        del graph


def _events_ms(runs, device, reps) -> float:
    def replay():
        for run in runs:
            run()
    return _replays(replay, device, reps, len(runs))
