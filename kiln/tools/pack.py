"""`kiln pack SRC OUT`: a model installed as a kiln packed directory (docs/format.md), and `kiln verify
DIR`. SRC is an HF folder, an mlx-community folder (its quantised values copied unchanged), a GGUF file
or a synth: spec. The tensors are written as the model reads them (its sanitize applied), the routed
experts one fixed-stride blob each; everything goes to OUT.partial, is hashed as it is written, read
back and checked, and only then renamed to OUT. A lock keeps two packs out of one OUT."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..cli.flags import positive_int
from ..errors import KilnError
from ..models import model_config
from ..ops.quant.reference import BITS, GROUP_SIZES, quantize
from ..weights import Checkpoint, open_checkpoint
from ..weights.packed import (
    BLOB_ALIGN,
    CORE,
    CORE_ALIGN,
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
from ..weights.synth import Spec, quant_format
from .quantize import write_tokenizer

EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")


def add_parser(sub) -> None:
    p = sub.add_parser("pack", help="install a model as a kiln packed directory (verified, expert blobs)")
    p.add_argument("src", help="HF or mlx-community folder, .gguf file, or synth:NAME spec")
    p.add_argument("out", help="the packed directory to create (must not exist)")
    p.add_argument("--bits", type=int, choices=BITS, default=None,
                   help="quantise 16-bit projections and embeddings on the way (MLX affine); "
                        "default: tensors as the source stores them")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64, help="with --bits (default 64)")
    p.add_argument("--router-bits", type=int, choices=BITS, default=None, help="MoE routers at these bits")
    p.add_argument("--expert-bits", type=int, choices=BITS, default=None, help="routed experts at these bits")
    p.add_argument("--discard-partial", action="store_true", help="start over from an existing OUT.partial")
    p.add_argument("--jobs", type=positive_int, default=4, help="parallel range requests (http sources)")
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


def expert_layers(shapes: dict) -> list[str]:
    """The prefixes (`model.layers.N.mlp.`) holding both routed expert stacks."""
    prefixes = [n[: -len(EXPERT_STACKS[0])] for n in shapes if n.endswith(EXPERT_STACKS[0])]
    return [p for p in prefixes if p + EXPERT_STACKS[1] in shapes and len(shapes[p + EXPERT_STACKS[0]]) == 3]


def stored(ckpt: Checkpoint, name: str, spec: Spec | None):
    """Tensor `name` as it is written: the source's, or quantised where --bits asks for it."""
    w = ckpt.load(name)
    if spec is None or isinstance(w, QuantizedWeight) or not w.is_floating_point():
        return w
    fmt = quant_format(spec, name, tuple(w.shape))
    return w if fmt is None else quantize(w.contiguous(), *fmt)


def part_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class HashedFile:
    """A file written front to back, hashed as it goes, padded to offsets on request."""

    def __init__(self, path: Path, bar):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f, self.h, self.at, self.bar = open(path, "wb"), hashlib.sha256(), 0, bar

    def write(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.at += len(b)
        self.bar.update(len(b))

    def pad_to(self, offset: int) -> None:
        if offset > self.at:
            self.write(bytes(offset - self.at))

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"size": self.at, "sha256": self.h.hexdigest()}


def write_core(tmp: Path, ckpt: Checkpoint, names: list[str], spec, bar) -> tuple[dict, dict]:
    f, tensors = HashedFile(tmp / CORE, bar), {}
    for name in names:
        w = stored(ckpt, name, spec)
        parts = {}
        for key, t in parts_of(w).items():
            f.pad_to(align(f.at, CORE_ALIGN))
            parts[key] = part_record(t, f.at)
            f.write(part_bytes(t))
        tensors[name] = tensor_record(w, parts)
    return tensors, f.close()


def write_experts(tmp: Path, ckpt: Checkpoint, prefix: str, index: int, spec, bar) -> tuple[dict, str, dict]:
    """One layer's routed experts as fixed-stride blobs: expert e's parts at e * stride + their offsets."""
    stacks = {prefix + s: stored(ckpt, prefix + s, spec) for s in EXPERT_STACKS}
    count = next(iter(stacks.values())).shape[0]
    at, layout, tensors = 0, [], {}
    for name, w in stacks.items():
        parts = {}
        for key, t in parts_of(w).items():
            at = align(at, CORE_ALIGN)
            parts[key] = part_record(t[0], at)           # one expert's part, at its offset in every blob
            layout.append((t, at))
            at += parts[key]["nbytes"]
        tensors[name] = tensor_record(w, parts)
    stride = align(at, BLOB_ALIGN)
    rel = f"experts/layer_{index:03d}.bin"
    f = HashedFile(tmp / rel, bar)
    for e in range(count):
        for t, offset in layout:
            f.pad_to(e * stride + offset)
            f.write(part_bytes(t[e]))
        f.pad_to((e + 1) * stride)
    layer = {"prefix": prefix, "file": rel, "count": count, "stride": stride, "alignment": BLOB_ALIGN,
             "tensors": tensors}
    return layer, rel, f.close()


def source_identity(src: str, ckpt: Checkpoint) -> dict:
    ident = {"kind": "mlx" if "quantization" in ckpt.config else ckpt.format, "path": str(src)}
    p = Path(src).expanduser()
    if p.is_dir():
        for name in ("model.safetensors.index.json", "config.json"):
            if (p / name).is_file():
                ident["index"], ident["index_sha256"] = name, sha256_file(p / name)
                break
    return ident


def pack(src: str, out: Path, spec: Spec | None, quiet: bool) -> dict:
    """Write the packed directory to OUT.partial, check it, rename it to OUT; the manifest."""
    source = open_checkpoint(src, verify="full")
    ckpt = model_view(source)
    layers = expert_layers(ckpt.shapes)
    in_layers = {p + s for p in layers for s in EXPERT_STACKS}
    core_names = [n for n in ckpt.shapes if n not in in_layers]
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)     # a local source is re-read whole: nothing of an earlier attempt is kept
    tmp.mkdir()
    files = {}
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="pack", file=sys.stderr, disable=quiet) as bar:
        tensors, files[CORE] = write_core(tmp, ckpt, core_names, spec, bar)
        expert_info = []
        for i, prefix in enumerate(layers):
            layer, rel, files[rel] = write_experts(tmp, ckpt, prefix, i, spec, bar)
            expert_info.append(layer)
    if source.format in ("hf", "gguf"):
        write_tokenizer(source, tmp)
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp).as_posix()
        if p.is_file() and rel not in files:
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, "version": VERSION, "source": source_identity(src, source),
                "config": ckpt.config, "generation": ckpt.generation,
                "quantization": None if spec is None else {"bits": spec.bits, "group_size": spec.group,
                                                           "router_bits": spec.router, "expert_bits": spec.experts},
                "tensors": tensors, "experts": {"layers": expert_info} if expert_info else {},
                "files": dict(sorted(files.items()))}
    raw = json.dumps(manifest, indent=1, default=str).encode()
    (tmp / MANIFEST).write_bytes(raw)
    (tmp / MANIFEST_HASH).write_text(f"{hashlib.sha256(raw).hexdigest()}  {MANIFEST}\n")
    bad = verify_dir(tmp)            # what is on disk, read back: the hashes taken as it was written
    if bad:
        raise KilnError(f"{tmp}: the written files do not check ({bad[0]}); nothing was installed")
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
            fcntl.flock(f, fcntl.LOCK_UN)


def main(a) -> int:
    t0 = time.perf_counter()
    if str(a.src).startswith(("http://", "https://")):
        raise KilnError("kiln pack does not read http(s) sources yet: download the repository and pack the folder")
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
        manifest = pack(a.src, out, spec, a.quiet)
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
              disable=a.quiet) as bar:
        bad = verify_dir(d, bar.update)
    for line in bad:
        print(f"kiln verify: {d}: {line}", file=sys.stderr)
    if bad:
        return 1
    print(f"{d}: ok")
    return 0
