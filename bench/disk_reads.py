"""Experts homed on disk: how fast the decode's staged reads land a layer's misses in pinned memory.

    PYTHONPATH=. python3 bench/disk_reads.py OUT.json [--model qwen3.5-35b-a3b] [--misses 5] [--layers 64]
        [--threads 8] [--dir DIR]

Writes one layer file shaped as MODEL's 4-bit g64 experts (the packed format's blob: gate|up and
down, each words, scales and biases at 64-byte aligned offsets, a 4 KiB stride; random bytes), reads
it once (warm page cache), then times, per layer of `--misses` random experts:
- `raw`: one of the bound's two measurements (kiln.tools.benchutil.disk_gb_s, which takes the faster
  of this and reads in pieces): every read of a blob by the
  pool at once, no copy;
- `whole`: each miss one pread of its blob into a thread buffer, then copied into its staging slot
  (ExpertStore._staged before 2026-12-04);
- `pieces`: the store's reads (DiskHome.reads): each miss's parts read straight into the staging
  slot, in pieces of up to PIECE bytes, all misses' pieces in flight at once.
GB/s of expert bytes each way; what is timed is only the host side (no GPU needed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.tools.benchutil import environment, now_iso
from kiln.weights import experts
from kiln.weights.experts import DiskHome, _empty_like_stack, _slot, read_staged

SHAPES = {  # (gate|up rows, hidden, down rows = hidden, moe width), experts a layer
    "qwen3.5-35b-a3b": ((1024, 2048, 2048, 512), 256),
    "gemma4-26b-a4b": ((1408, 2816, 2816, 704), 128),
    "qwen3.5-397b-a17b": ((2048, 4096, 4096, 1024), 512),
}


def layout(rows_in: int, cols_in: int, rows_out: int, cols_out: int, bits: int = 4, group: int = 64) -> tuple:
    """The blob's records (as a packed manifest's, bf16 scales and biases) and its stride."""
    records, at = {}, 0
    for name, (r, c) in (("experts.gate_up_proj", (rows_in, cols_in)), ("experts.down_proj", (rows_out, cols_out))):
        parts = {}
        side = (r, c // group)
        for part, shape, dtype, item in (("weight", (r, c * bits // 32), "i32", 4),
                                         ("scales", side, "bf16", 2), ("biases", side, "bf16", 2)):
            n = shape[0] * shape[1] * item
            parts[part] = {"offset": at, "nbytes": n, "dtype": dtype, "shape": list(shape)}
            at = -(-(at + n) // 64) * 64
        records[name] = {"parts": parts, "quant": {"bits": bits, "group_size": group}}
    return records, -(-at // 4096) * 4096


def staging(home: DiskHome, count: int) -> dict:
    sample = home.read(0)
    return {n: _empty_like_stack(w, count, "cpu", pin=torch.cuda.is_available()) for n, w in sample.items()}


def whole(home, pool, stage, missing):
    for f in [pool.submit(home.read_into, e, {n: _slot(w, j) for n, w in stage.items()})
              for j, e in enumerate(missing)]:
        f.result()


def pieces(home, pool, stage, missing):
    read_staged(home, pool, stage, missing)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3.5-35b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--misses", type=int, default=5)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--piece", type=int, default=None, help="bytes a piece (default kiln's PIECE)")
    a = ap.parse_args(argv)
    if a.piece:
        experts.PIECE = a.piece
    from concurrent.futures import ThreadPoolExecutor

    dims, count = SHAPES[a.model]
    records, stride = layout(*dims)
    folder = tempfile.mkdtemp(dir=a.dir)
    path = Path(folder) / "layer.bin"
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(os.urandom(stride))
    home = DiskHome(path, stride, count, records, convert=lambda w: w)
    home.open()
    with open(path, "rb") as f:         # the page cache warm, as a run after the first reads
        while f.read(1 << 24):
            pass
    pool = ThreadPoolExecutor(max_workers=a.threads)
    stage = staging(home, a.misses)
    g = torch.Generator().manual_seed(0)
    plans = [torch.randperm(count, generator=g)[:a.misses].tolist() for _ in range(a.layers)]
    pieces(home, pool, stage, plans[0])
    bits = lambda w: [t.view(torch.uint8).clone() for t in (w.packed, w.scales, w.biases)]  # noqa: E731 (random bytes: NaNs)
    want = {n: bits(w) for n, w in stage.items()}
    for w in stage.values():
        w.packed.zero_(), w.scales.zero_(), w.biases.zero_()
    whole(home, pool, stage, plans[0])
    same = all(all(torch.equal(x, y) for x, y in zip(bits(w), want[n])) for n, w in stage.items())
    out = {"model": a.model, "stride": stride, "piece": experts.PIECE, "misses": a.misses, "layers": a.layers,
           "threads": a.threads, "pieces_equal_whole": same, "gb_s": {}}
    total = a.layers * a.misses * stride
    for rnd in range(a.rounds):
        for name, fn in (("whole", whole), ("pieces", pieces)):
            t = time.perf_counter()
            for missing in plans:
                fn(home, pool, stage, missing)
            out["gb_s"].setdefault(name, []).append(round(total / (time.perf_counter() - t) / 1e9, 2))
        t = time.perf_counter()
        flat = [e for m in plans for e in m]
        list(pool.map(lambda e: home._stored(e) and None, flat))
        out["gb_s"].setdefault("raw", []).append(round(total / (time.perf_counter() - t) / 1e9, 2))
    command = " ".join([sys.argv[0], *(argv or sys.argv[1:])])
    out.update(environment(torch.device("cpu")), date=now_iso(), command=command)
    path.unlink()
    os.rmdir(folder)
    print(json.dumps(out["gb_s"]), "pieces equal whole:", same)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
