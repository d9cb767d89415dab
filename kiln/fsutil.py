"""Where kiln keeps its files, and how it writes them: a reader sees the old version or the whole new
one, never a half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, write) -> None:
    """Call write(file) on a temporary file beside `path`, then rename it over `path`."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_dir() -> Path:
    """kiln's cache: models, tune choices, compiled kernels, tokenizers ($KILN_CACHE_DIR)."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
