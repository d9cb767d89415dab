"""The tune cache: JSON files under $KILN_CACHE_DIR/tune (default ~/.cache/kiln/tune), one per
(device, model shape signature, dtype). Each file records the full key it was measured under:
GPU name, SM count, compute capability, driver, CUDA, torch and Triton versions, a hash of each
op's kernel sources, the shape signature and the dtype. A file whose key differs (stale), or that
cannot be read as a whole (corrupt or partial), is ignored with a warning; where only some ops'
sources changed, those ops' entries are dropped (and measured again) and the rest are kept. A
workload missing from its model's file is looked up in the other files of the same GPU, dtype,
versions and op sources (`borrow`): a shape tuned for one model or context is not measured again
for another. Writers write a
temporary file and rename it, so a reader never sees half a file and concurrent writers cannot
corrupt it (the last rename wins).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from ..fsutil import cache_dir, write_atomic

FORMAT = 2      # 2: sources hashed per op
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def cache_root() -> Path:
    return cache_dir() / "tune"


@functools.lru_cache(maxsize=None)
def driver_version() -> str | None:
    """The NVIDIA driver release (e.g. 580.159.03), read without starting CUDA where possible."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def environment(dev) -> dict:
    """What the measurements depend on besides the kernels and the model."""
    import triton

    cuda = dev.capability is not None
    return {"gpu": dev.name, "sms": dev.sms, "capability": ".".join(map(str, dev.capability)) if cuda else None,
            "driver": driver_version() if cuda else None, "cuda": torch.version.cuda if cuda else None,
            "torch": torch.__version__, "triton": triton.__version__}


def sources_hash(ops) -> dict[str, str]:
    """op name -> a hash of the files its kernels come from (op.sources)."""
    out = {}
    for op in sorted(ops, key=lambda o: o.name):
        h = hashlib.sha256(op.name.encode())
        for path in sorted(set(op.sources)):
            h.update(Path(path).read_bytes())
        out[op.name] = h.hexdigest()[:16]
    return out


def signature(labels: list[str]) -> str:
    """The model's shape signature: a hash of every (op, shape) it runs."""
    return hashlib.sha256("\n".join(sorted(set(labels))).encode()).hexdigest()[:16]


def make_key(dev, dtype: torch.dtype, ops, labels: list[str]) -> dict:
    return {"format": FORMAT, **environment(dev), "sources": sources_hash(ops), "model": signature(labels),
            "dtype": DTYPE_NAMES.get(dtype, str(dtype))}


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower() or "device"


def read(path: Path) -> dict:
    """A cache file's {key, entries}; ValueError if it is not a whole, well-formed one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("key"), dict) or not isinstance(data.get("entries"), dict):
        raise ValueError("not a kiln tune cache")
    if not all(isinstance(e, dict) and isinstance(e.get("variant"), str) for e in data["entries"].values()):
        raise ValueError("malformed entries")
    return data


def key_changes(old: dict, key: dict, ignore: tuple[str, ...]) -> list[str]:
    """The key fields (but `ignore`) that differ between a file's key and ours; "sources" too if the
    file's per-op source hashes are missing."""
    changed = sorted(k for k in set(key) | set(old) if k not in ignore and key.get(k) != old.get(k))
    return changed if isinstance(old.get("sources"), dict) else changed + ["sources"]


def changed_ops(old: dict, sources: dict) -> list[str]:
    """Ops whose kernel sources hash differently now."""
    return sorted(op for op, h in sources.items() if old.get(op) != h)


def without_ops(entries: dict, ops: list[str]) -> dict:
    """Entries whose label ("OP SHAPE") is not of one of `ops`."""
    return {label: e for label, e in entries.items() if label.split(" ", 1)[0] not in ops}


class TuneCache:
    def __init__(self, root: Path | None = None, warn: Callable[[str], None] | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))

    def path(self, key: dict) -> Path:
        return self.root / f"{_slug(key['gpu'])}_{key['model']}_{key['dtype']}.json"

    def load(self, key: dict) -> dict | None:
        """The entries measured under exactly this key, or None (no file, or one to ignore)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = read(path)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self.warn(f"[kiln] warning: ignoring corrupt tune cache {path} ({type(e).__name__}: {e})")
            return None
        if changes := key_changes(data["key"], key, ignore=("sources",)):
            self.warn(f"[kiln] warning: ignoring stale tune cache {path} ({', '.join(changes)} changed)")
            return None
        changed = changed_ops(data["key"]["sources"], key["sources"])
        if changed:
            self.warn(f"[kiln] warning: stale tune cache entries in {path} (sources of {', '.join(changed)} "
                      f"changed): those ops are measured again")
        return without_ops(data["entries"], changed)

    def borrow(self, key: dict, labels: set[str]) -> dict:
        """Entries for `labels` measured for other models (other files) on this GPU, in this dtype,
        under the same versions and the same kernel sources of their op: a workload's label names
        its op and whole shape, so its choice does not depend on the model around it. Files that
        cannot be read are skipped silently (their own model warns when it loads them)."""
        out: dict = {}
        for path in sorted(self.root.glob(f"{_slug(key['gpu'])}_*_{key['dtype']}.json")):
            if path == self.path(key) or not labels - {label for label, e in out.items() if not e.get("gated")}:
                continue
            try:
                data = read(path)
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if key_changes(data["key"], key, ignore=("sources", "model")):
                continue
            fresh = without_ops(data["entries"], changed_ops(data["key"]["sources"], key["sources"]))
            # a measured choice wins over a default another file only gated (tuner.Tuner.cached)
            out.update({label: e for label, e in fresh.items() if label in labels
                        and (label not in out or (out[label].get("gated") and not e.get("gated")))})
        return out

    def save(self, key: dict, entries: dict) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"key": key, "entries": entries}, indent=1, sort_keys=True).encode()
        write_atomic(path, lambda f: f.write(data))  # concurrent writers cannot leave half a file
        return path
