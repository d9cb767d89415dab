"""`kiln pack SRC OUT`: a model installed as a kiln packed directory (docs/format.md), and `kiln verify
DIR`. SRC is an HF folder, an mlx-community folder (its quantised values copied unchanged), a GGUF file,
a synth: spec or the URL of an HF-style repository (kiln/weights/remote.py). The tensors are written as
the model reads them (its sanitize applied), the routed experts one fixed-stride blob each. Everything
goes to OUT.partial a unit at a time (a core tensor, an expert layer), hashed as it is written and
recorded in a checkpoint, so a rerun resumes; at the end every file is read back and checked, and only
then is OUT.partial renamed to OUT. A lock keeps two packs out of one OUT."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..cli.flags import positive_int
from ..errors import KilnError
from ..fsutil import write_atomic
from ..models import model_config
from ..ops.quant.reference import BITS, GROUP_SIZES, quantize
from ..weights import Checkpoint, open_checkpoint
from ..weights.packed import (
    BLOB_ALIGN,
    CORE,
    CORE_ALIGN,
    DTYPE_NAMES,
    FORMAT,
    MANIFEST,
    MANIFEST_HASH,
    VERSION,
    align,
    part_record,
    parts_of,
    sha256_file,
    tensor_record,
    verify_dir,
)
from ..weights.quantized import QuantizedWeight
from ..weights.remote import CHUNK, Remote, open_remote
from ..weights.synth import Spec, quant_format
from .quantize import TOKENIZER_FILES, write_tokenizer

EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")
STATE = ".pack-state.json"       # OUT.partial's checkpoint (State)
HASH_CHUNK = 8 << 20


def add_parser(sub) -> None:
    p = sub.add_parser("pack", help="install a model as a kiln packed directory (verified, expert blobs)")
    p.add_argument("src", help="HF or mlx-community folder, .gguf file, synth:NAME spec, or the http(s) URL of an "
                               "HF-style repository (read with range requests)")
    p.add_argument("out", help="the packed directory to create (must not exist)")
    p.add_argument("--bits", type=int, choices=BITS, default=None,
                   help="quantise 16-bit projections and embeddings on the way (MLX affine); "
                        "default: tensors as the source stores them")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64, help="with --bits (default 64)")
    p.add_argument("--router-bits", type=int, choices=BITS, default=None, help="MoE routers at these bits")
    p.add_argument("--expert-bits", type=int, choices=BITS, default=None, help="routed experts at these bits")
    p.add_argument("--revision", default="main", help="a URL source's branch, tag or commit (pinned to the commit "
                                                     "it resolves to; default main)")
    p.add_argument("--discard-partial", action="store_true",
                   help="start over where OUT.partial holds a pack of another source or plan (default: refuse)")
    p.add_argument("--jobs", type=positive_int, default=4, help="range requests in flight (URL sources; default 4)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(main=main)
    v = sub.add_parser("verify", help="check a packed directory's files against its manifest")
    v.add_argument("dir", help="a directory written by kiln pack")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(main=main_verify)


# -- what is written -----------------------------------------------------------------------------

def model_view(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint as the model reads it: its declared tensors, its family's sanitize applied."""
    cls, cfg = model_config(ckpt.config)
    ckpt = ckpt.for_model(cls.checkpoint_shapes(cfg), cls.norm_style == "offset")
    return ckpt if ckpt.sanitized else cls.sanitize(ckpt)


def expert_layers(shapes: dict) -> list[tuple[int, str]]:
    """(layer number, prefix) of the layers holding both routed expert stacks (`model.layers.N.mlp.`), in
    layer order: whatever order a reader lists the tensors in, the files are the same."""
    prefixes = [n[: -len(EXPERT_STACKS[0])] for n in shapes if n.endswith(EXPERT_STACKS[0])]
    found = [p for p in prefixes if p + EXPERT_STACKS[1] in shapes and len(shapes[p + EXPERT_STACKS[0]]) == 3]
    numbered = [(int(m[1]) if (m := re.search(r"layers\.(\d+)\.", p)) else i, p) for i, p in enumerate(found)]
    return sorted(numbered)


def stored(ckpt: Checkpoint, name: str, spec: Spec | None):
    """Tensor `name` as it is written: the source's, or quantised where --bits asks for it."""
    w = ckpt.load(name)
    if spec is None or isinstance(w, QuantizedWeight) or not w.is_floating_point():
        return w
    fmt = quant_format(spec, name, tuple(w.shape))
    return w if fmt is None else quantize(w.contiguous(), *fmt)


def streamed(ckpt: Checkpoint, name: str, spec: Spec | None):
    """Where tensor `name` is copied as its source stores it (no transform, not quantised on the way),
    its span (FileSpan or RemoteSpan: dtype, shape, nbytes): written a window at a time, never held."""
    span = ckpt.locate(name)
    if span is None or (spec is not None and span.dtype.is_floating_point
                        and quant_format(spec, name, tuple(span.shape)) is not None):
        return None
    return span


def span_chunks(span):
    if hasattr(span, "chunks"):
        yield from span.chunks()
        return
    with open(span.path, "rb") as f:
        f.seek(span.offset)
        left = span.nbytes
        while left:
            chunk = f.read(min(HASH_CHUNK, left))
            if not chunk:
                raise KilnError(f"{span.path}: ends before the tensor it declares")
            yield chunk
            left -= len(chunk)


class Pieces:
    """Exact byte counts taken in order from an iterator of chunks of any size (a stack's experts from
    its span's windows)."""

    def __init__(self, chunks):
        self.chunks, self.buf = iter(chunks), bytearray()

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = next(self.chunks, None)
            if chunk is None:
                raise KilnError(f"the source ended {n - len(self.buf)} bytes early")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def part_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def region_sha(path: Path, offset: int, nbytes: int) -> str | None:
    """SHA-256 of bytes [offset, offset + nbytes) of `path`, None where the file is shorter."""
    if not path.is_file() or path.stat().st_size < offset + nbytes:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = nbytes
        while left:
            chunk = f.read(min(HASH_CHUNK, left))
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def killed_at(point: str) -> None:
    """KILN_PACK_KILL_AT=POINT (tests): the process SIGKILLs itself there (`unit:N` after the N-th unit
    this run writes, `hashing` after the final check's first file), as a power cut would stop it."""
    if os.environ.get("KILN_PACK_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


class State:
    """OUT.partial's checkpoint: the source's identity, the plan's fingerprint and each completed unit
    (a core tensor or an expert layer: file, offset, size, SHA-256 of the bytes written, its manifest
    record), written atomically after each unit. A rerun re-hashes a unit's bytes before keeping it."""

    def __init__(self, tmp: Path, source: dict, plan: str):
        self.path, self.source, self.plan, self.units, self.written = tmp / STATE, source, plan, {}, 0

    @classmethod
    def resume(cls, tmp: Path, source: dict, plan: str, discard: bool) -> "State":
        state = cls(tmp, source, plan)
        if tmp.exists():
            try:
                old = json.loads((tmp / STATE).read_text())
            except (OSError, ValueError):
                old = None      # killed before its first unit: nothing worth keeping
            if old is not None and (old.get("source") != source or old.get("plan") != plan) and not discard:
                what = "source" if old.get("source") != source else "plan (flags or model)"
                raise KilnError(f"{tmp} holds a pack of another {what}: rerun with --discard-partial to start over")
            if old is None or discard or old.get("source") != source or old.get("plan") != plan:
                shutil.rmtree(tmp)
            else:
                state.units = old["units"]
        tmp.mkdir(exist_ok=True)
        return state

    def kept(self, key: str, file: Path, offset: int) -> dict | None:
        """The unit's record where its bytes on disk still hash as written, else None (fetch again)."""
        u = self.units.get(key)
        if u is None or u["offset"] != offset or region_sha(file, offset, u["nbytes"]) != u["sha256"]:
            return None
        return u

    def done(self, key: str, unit: dict) -> None:
        self.units[key] = unit
        write_atomic(self.path, lambda f: f.write(json.dumps({"source": self.source, "plan": self.plan,
                                                              "units": self.units}).encode()))
        self.written += 1
        killed_at(f"unit:{self.written}")


class Region:
    """Bytes laid out from `offset` of an open file, parts padded to offsets, hashed as written."""

    def __init__(self, f, offset: int, bar):
        self.f, self.start, self.at, self.h, self.bar = f, offset, offset, hashlib.sha256(), bar
        f.seek(offset)

    def write(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.at += len(b)
        self.bar.update(len(b))

    def pad_to(self, offset: int) -> None:
        if offset > self.at:
            self.write(bytes(offset - self.at))

    def unit(self, record: dict) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        return {"offset": self.start, "nbytes": self.at - self.start, "sha256": self.h.hexdigest(), "record": record}


def write_core(tmp: Path, ckpt: Checkpoint, names: list[str], spec, state: State, bar) -> dict:
    """core.bin, a tensor at a time (each part at a 64-byte offset); units kept from an earlier run
    are re-hashed, not fetched again."""
    path, tensors, at = tmp / CORE, {}, 0
    path.touch()
    with open(path, "r+b") as f:
        for name in names:
            offset = align(at, CORE_ALIGN)
            unit = state.kept(name, path, offset)
            if unit is None:
                region = Region(f, offset, bar)
                if (span := streamed(ckpt, name, spec)) is not None:
                    parts = {"tensor": {"offset": offset, "nbytes": span.nbytes, "dtype": DTYPE_NAMES[span.dtype],
                                        "shape": list(span.shape)}}
                    for chunk in span_chunks(span):
                        region.write(chunk)
                    record = {"shape": list(span.shape), "parts": parts}
                else:
                    w, parts = stored(ckpt, name, spec), {}
                    for key, t in parts_of(w).items():
                        region.pad_to(align(region.at, CORE_ALIGN))
                        parts[key] = part_record(t, region.at)
                        region.write(part_bytes(t))
                    record = tensor_record(w, parts)
                unit = region.unit(record)
                state.done(name, unit)
            else:
                bar.update(unit["nbytes"])
            tensors[name], at = unit["record"], offset + unit["nbytes"]
        f.truncate(at)
    return tensors


def write_experts(tmp: Path, ckpt: Checkpoint, prefix: str, index: int, spec, state: State, bar) -> dict:
    """One layer's routed experts as fixed-stride blobs: expert e's parts at e * stride + their offsets.
    Written to a temporary name and renamed: a layer file is whole or absent."""
    rel = f"experts/layer_{index:03d}.bin"
    unit = state.kept(rel, tmp / rel, 0)
    if unit is not None:
        bar.update(unit["nbytes"])
        return unit["record"]
    spans = {prefix + s: streamed(ckpt, prefix + s, spec) for s in EXPERT_STACKS}
    if all(spans.values()):     # both stacks as stored: each expert's bytes read in turn, never a stack
        count = next(iter(spans.values())).shape[0]
        at, layout, tensors = 0, [], {}
        for name, span in spans.items():
            at = align(at, CORE_ALIGN)
            one = {"offset": at, "nbytes": span.nbytes // count, "dtype": DTYPE_NAMES[span.dtype],
                   "shape": list(span.shape[1:])}
            tensors[name] = {"shape": list(span.shape), "parts": {"tensor": one}}
            pieces = Pieces(span_chunks(span))
            layout.append((lambda e, p=pieces, n=one["nbytes"]: p.take(n), at))
            at += one["nbytes"]
    else:
        stacks = {prefix + s: stored(ckpt, prefix + s, spec) for s in EXPERT_STACKS}
        count = next(iter(stacks.values())).shape[0]
        at, layout, tensors = 0, [], {}
        for name, w in stacks.items():
            parts = {}
            for key, t in parts_of(w).items():
                at = align(at, CORE_ALIGN)
                parts[key] = part_record(t[0], at)           # one expert's part, at its offset in every blob
                layout.append((lambda e, t=t: part_bytes(t[e]), at))
                at += parts[key]["nbytes"]
            tensors[name] = tensor_record(w, parts)
    stride = align(at, BLOB_ALIGN)
    (tmp / "experts").mkdir(exist_ok=True)
    part = tmp / (rel + ".tmp")
    with open(part, "wb") as f:
        region = Region(f, 0, bar)
        for e in range(count):
            for expert_bytes, offset in layout:
                region.pad_to(e * stride + offset)
                region.write(expert_bytes(e))
            region.pad_to((e + 1) * stride)
        record = {"prefix": prefix, "file": rel, "count": count, "stride": stride, "alignment": BLOB_ALIGN,
                  "tensors": tensors}
        unit = region.unit(record)
    os.replace(part, tmp / rel)
    state.done(rel, unit)
    return record


def open_source(src: str, revision: str, jobs: int) -> tuple[Checkpoint, dict, Remote | None]:
    """The source checkpoint, its identity (what a resume must find unchanged) and, for a URL, the
    repository it is read from."""
    if src.startswith(("http://", "https://")):
        remote = Remote(src, revision, jobs=jobs, chunk=int(os.environ.get("KILN_PACK_RANGE_BYTES", CHUNK)))
        ckpt = open_remote(remote)
        index = "model.safetensors.index.json" if remote.size("model.safetensors.index.json") else "config.json"
        digest = hashlib.sha256(remote.read(index, 0, remote.size(index))).hexdigest()
        return ckpt, {"kind": "http", "url": src, "revision": revision, "commit": remote.commit, "index": index,
                      "index_sha256": digest}, remote
    ckpt = open_checkpoint(src, verify="full")
    ident = {"kind": "mlx" if "quantization" in ckpt.config else ckpt.format, "path": str(Path(src).resolve())
             if not src.startswith("synth:") else src}
    p = Path(src).expanduser()
    if p.is_file():
        st = p.stat()
        ident["size"], ident["mtime_ns"] = st.st_size, st.st_mtime_ns
    elif p.is_dir():
        for name in ("model.safetensors.index.json", "config.json"):
            if (p / name).is_file():
                ident["index"], ident["index_sha256"] = name, sha256_file(p / name)
                break
    return ckpt, ident, None


def fetch_tokenizer(remote: Remote, tmp: Path) -> None:
    """The repository's tokenizer and generation files that exist, fetched whole (they are small)."""
    for name in TOKENIZER_FILES:
        size = remote.size(name)
        if size:
            data = remote.read(name, 0, size)
            write_atomic(tmp / name, lambda f, d=data: f.write(d))


def hash_checked(path: Path, units: list[dict]) -> str:
    """The file's SHA-256, read once, checking on the way that each unit's bytes still hash as they
    did when written (a byte changed on disk since is an error, not part of an install)."""
    whole, spans = hashlib.sha256(), sorted((u["offset"], u["offset"] + u["nbytes"], u) for u in units)
    open_spans = [(a, b, u, hashlib.sha256()) for a, b, u in spans]
    at = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            whole.update(chunk)
            end = at + len(chunk)
            for a, b, _, h in open_spans:
                if a < end and b > at:
                    h.update(chunk[max(a, at) - at:min(b, end) - at])
            at = end
    for a, _, u, h in open_spans:
        if h.hexdigest() != u["sha256"]:
            raise KilnError(f"{path}: bytes at {a} changed after they were written; run the same command again "
                            f"to rewrite them")
    return whole.hexdigest()


def plan_fingerprint(ckpt: Checkpoint, spec: Spec | None, layers: list[str]) -> str:
    plan = {"version": VERSION, "spec": None if spec is None else [spec.bits, spec.group, spec.router, spec.experts],
            "tensors": sorted([n, list(s)] for n, s in ckpt.shapes.items()), "layers": layers}
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def pack(src: str, out: Path, spec: Spec | None, quiet: bool, revision: str = "main", jobs: int = 4,
         discard: bool = False) -> dict:
    """Write the packed directory to OUT.partial (resuming what an earlier run completed), check it,
    rename it to OUT; the manifest."""
    source, ident, remote = open_source(src, revision, jobs)
    ckpt = model_view(source)
    layers = expert_layers(ckpt.shapes)
    in_layers = {p + s for _, p in layers for s in EXPERT_STACKS}
    core_names = sorted(n for n in ckpt.shapes if n not in in_layers)     # a reader's order is not the plan's
    tmp = out.with_name(out.name + ".partial")
    state = State.resume(tmp, ident, plan_fingerprint(ckpt, spec, layers), discard)
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="pack", file=sys.stderr, disable=quiet) as bar:
        tensors = write_core(tmp, ckpt, core_names, spec, state, bar)
        expert_info = [write_experts(tmp, ckpt, prefix, i, spec, state, bar) for i, prefix in layers]
    if remote is not None:
        fetch_tokenizer(remote, tmp)
    elif source.format in ("hf", "gguf"):
        write_tokenizer(source, tmp)
    files = {}
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp).as_posix()
        if p.is_file() and rel not in (STATE, MANIFEST, MANIFEST_HASH):
            units = [u for k, u in state.units.items() if k == rel or (rel == CORE and not k.startswith("experts/"))]
            files[rel] = {"size": p.stat().st_size, "sha256": hash_checked(p, units)}
            killed_at("hashing")
    manifest = {"format": FORMAT, "version": VERSION, "source": ident,
                "config": ckpt.config, "generation": ckpt.generation,
                "quantization": None if spec is None else {"bits": spec.bits, "group_size": spec.group,
                                                           "router_bits": spec.router, "expert_bits": spec.experts},
                "tensors": tensors, "experts": {"layers": expert_info} if expert_info else {},
                "files": files}
    raw = json.dumps(manifest, indent=1, default=str).encode()
    write_atomic(tmp / MANIFEST, lambda f: f.write(raw))
    write_atomic(tmp / MANIFEST_HASH, lambda f: f.write(f"{hashlib.sha256(raw).hexdigest()}  {MANIFEST}\n".encode()))
    (tmp / STATE).unlink()
    os.replace(tmp, out)
    return manifest


@contextmanager
def exclusive(out: Path):
    """An advisory lock on OUT.lock for the pack's duration: a second pack into OUT refuses."""
    lock = out.with_name(out.name + ".lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KilnError(f"another kiln pack is writing {out} (it holds {lock}); wait for it to finish") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)     # still held: a pack waiting on it fails now, not on a stale file
            fcntl.flock(f, fcntl.LOCK_UN)


def main(a) -> int:
    t0 = time.perf_counter()
    out = Path(a.out).expanduser()
    if out.exists():
        raise KilnError(f"{out} already exists (remove it or choose another)")
    if not out.parent.is_dir():
        raise KilnError(f"no such folder: {out.parent}")
    if a.bits is None and (a.router_bits or a.expert_bits):
        raise KilnError("--router-bits and --expert-bits need --bits")
    spec = None if a.bits is None else Spec("pack", bits=a.bits, group=a.group_size, router=a.router_bits,
                                            experts=a.expert_bits)
    with exclusive(out):
        manifest = pack(str(a.src), out, spec, a.quiet, revision=a.revision, jobs=a.jobs, discard=a.discard_partial)
    if not a.quiet:
        size = sum(f["size"] for f in manifest["files"].values())
        print(f"kiln: packed {len(manifest['tensors'])} tensors and {len(manifest['experts'].get('layers', []))} "
              f"expert layers, {size / (1 << 20):.1f} MiB, in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(out)
    return 0


def main_verify(a) -> int:
    d = Path(a.dir).expanduser()
    if not d.is_dir():
        raise KilnError(f"no such folder: {d}")
    try:
        total = sum(f["size"] for f in json.loads((d / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        total = None
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
              disable=a.quiet or total is None) as bar:
        bad = verify_dir(d, bar.update)
    for line in bad:        # a file's line names it relative to d; a manifest error names d itself
        print(f"kiln verify: {line if line.startswith(str(d)) else f'{d}: {line}'}", file=sys.stderr)
    if bad:
        return 1
    print(f"{d}: ok")
    return 0
