"""What `kiln bench` and `kiln profile` share: the machine and versions a number was measured on,
device synchronisation and peak memory, page-cache residency, Markdown tables, atomic writes."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..errors import KilnError
from ..fsutil import write_atomic  # noqa: F401  (bench and profile import it from here)
from ..tune.cache import driver_version

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


# -- the environment a number belongs to ---------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver version (one reader for the tune cache key and the bench JSON)."""

    return driver_version()


def kiln_commit() -> str | None:
    """HEAD of the checkout kiln runs from, with "-dirty" when tracked files differ from it.
    $KILN_COMMIT, when set, says it instead: the lent GPU machine's copy of the tree carries a
    stale .git (measured: it reported the session's first HEAD, "-dirty", for later commits)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return os.environ.get("KILN_COMMIT")
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment(device: torch.device) -> dict:
    """gpu (the device's name: the GPU's, or the CPU's on CPU), driver, and library versions."""
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "driver": _nvidia_driver() if cuda else None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "kiln_commit": kiln_commit(),
        "kiln_env": kiln_env(),
    }


def kiln_env() -> dict:
    """The KILN_* switches in effect (KILN_TUNE_SKIP, KILN_KERNELS_OFF, ...): they change what ran."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("KILN_") and k != "KILN_COMMIT"}


def process_start() -> float | None:
    """When this process started (epoch seconds), from /proc (Linux); None elsewhere. The time before
    Python ran (the interpreter, torch's import) belongs to what a user waits for the first token."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        boot = next(float(ln.split()[1]) for ln in open("/proc/stat") if ln.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")     # field 22 counts from 1, pid and comm cut
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """The command as the user typed it (the `kiln` entry point, or `python -m kiln.cli`)."""
    return shlex.join(["kiln", *sys.argv[1:]])


# -- device timing and memory ---------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch on CUDA; peak resident set of this process on CPU (GB = 1e9 B)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


# -- page cache ------------------------------------------------------------------------------------
def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _resident_pages(libc, path: Path, page: int) -> tuple[int, int]:
    """(resident pages, pages) of one file, by mincore(2) over a read-only shared mapping."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    n = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: touches no page
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            import numpy as np

            return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()), n
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_fraction(path: str | Path) -> tuple[float, int] | None:
    """(share of the checkpoint's pages already in the OS page cache, its bytes), or None where it
    cannot be told (no such file, no mincore). Reading it this way loads nothing into the cache."""
    p = Path(path)
    if not p.exists() or not sys.platform.startswith("linux"):
        return None
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    try:
        libc, page = _libc(), os.sysconf("SC_PAGE_SIZE")
        counts = [_resident_pages(libc, f, page) for f in files]
    except (OSError, AttributeError):
        return None
    pages = sum(n for _, n in counts)
    return (sum(r for r, _ in counts) / pages if pages else 0.0), sum(f.stat().st_size for f in files)


def page_cache_note(res: tuple[float, int] | None) -> str:
    if res is None:
        return "page cache state unknown"
    frac, nbytes = res
    state = "warm" if frac >= 0.99 else "cold" if frac <= 0.01 else "partly warm"
    return f"page cache {state}: {frac:.0%} of {nbytes / 1e6:.0f} MB resident before load (mincore)"


# -- output ------------------------------------------------------------------------------------------
def markdown_table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """A GitHub Markdown table; columns whose index is in `right` are right-aligned."""
    rule = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = [headers, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)



def check_writable(path: str | Path, flag: str) -> None:
    """Fail before a long run, not after it, when an output's folder does not exist."""
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise KilnError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise KilnError(f"{flag} {path}: folder {parent} is not writable")


HBM_BYTES_S = {"H200": 4.27e12}     # measured memory bandwidth (docs: the floor is bytes / 4.27 TB/s)


def hbm_bytes_s(gpu: str | None) -> float | None:
    """The measured bandwidth of this GPU, where the repository has one."""
    return next((bw for name, bw in HBM_BYTES_S.items() if gpu and name in gpu), None)


def token_bytes(model) -> int:
    """Weight bytes one decode token reads: every weight (quantised ones packed, with their scales and
    biases), routed experts ([E, ...] under `.experts.` or `.switch_mlp.`) k / E of theirs, an
    embedding with an LM head of its own one row; the KV cache and state are not counted."""
    cfg = model.cfg
    k, e = getattr(cfg, "num_experts_per_tok", 0), getattr(cfg, "num_experts", 0)
    total = 0
    for name, w in model.w.items():
        b = w.nbytes
        if e and (".experts." in name or ".switch_mlp." in name):
            b = b * k // e
        elif "embed_tokens" in name and "lm_head.weight" in model.w:
            b = b // w.shape[0]
        total += b
    return total


def quant_summary(model) -> dict | None:
    """{bits, group_size, bytes_per_token, quantised, formats}: the format of most of the quantised
    bytes (a model can keep its router at 8 bits), the weight bytes a decode token reads (token_bytes),
    how many weights are quantised and in which formats; None for a 16-bit model."""
    by_format: dict[tuple[int, int], int] = {}
    for w in model.w.values():
        if hasattr(w, "bits"):
            by_format[(w.bits, w.group_size)] = by_format.get((w.bits, w.group_size), 0) + w.nbytes
    if not by_format:
        return None
    bits, group = max(by_format, key=by_format.get)
    return {"bits": bits, "group_size": group, "bytes_per_token": token_bytes(model),
            "quantised": sum(hasattr(w, "bits") for w in model.w.values()),
            "formats": sorted(f"{b}-bit g{g}" for b, g in by_format)}


# -- streamed experts: the rates their bytes move at (docs/streaming.md) -----------------------------
_READ_KERNEL = None


def _read_kernel():
    """A Triton kernel summing BLOCK int32 words a program: mapped host memory read in place."""
    global _READ_KERNEL
    if _READ_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0), axis=0))
        _READ_KERNEL = read_kernel
    return _READ_KERNEL


def link_gb_s(device: torch.device, nbytes: int = 1 << 30) -> dict:
    """Pinned host -> device (best of 3): a copy's GB/s, and a kernel reading the host memory in
    place; None off CUDA."""
    if device.type != "cuda":
        return {"copy": None, "in_place": None}
    host = torch.ones(nbytes // 4, dtype=torch.int32).pin_memory()
    dst = torch.empty_like(host, device=device)
    block = 4096
    out = torch.empty(-(-host.numel() // block), dtype=torch.int32, device=device)
    best = {"copy": 0.0, "in_place": 0.0}
    for _ in range(3):
        for kind in best:
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            if kind == "copy":
                dst.copy_(host, non_blocking=True)
            else:
                _read_kernel()[(out.numel(),)](host, out, host.numel(), BLOCK=block)
            torch.cuda.synchronize(device)
            best[kind] = max(best[kind], nbytes / (time.perf_counter() - t) / 1e9)
    if int(out.sum()) != host.numel():
        raise RuntimeError("the link measurement's kernel did not read every word")
    return {k: round(v, 1) for k, v in best.items()}


def disk_gb_s(store, reads: int = 512, seed: int = 2) -> float | None:
    """Experts homed on disk: GB/s of `reads` random expert blobs read by the store's I/O threads,
    through the page cache as a run reads them (warm if the files are cached); None for other homes.
    The faster of the store's two ways: one pread a blob into a thread's buffer, and preadv pieces of
    PIECE bytes, all in flight, into one reused (pinned, on a GPU machine) buffer as the decode's staged
    reads land; on the H200's host the pieces ran 3-4x the blobs (bench/NOTES.md, 2026-12-05), so a
    bound from the blobs alone understated the disk."""
    from ..weights.experts import PIECE, DiskHome

    homes = [h for h in store.homes.values() if isinstance(h, DiskHome)]
    if not homes:
        return None
    g = torch.Generator().manual_seed(seed)
    layer = torch.randint(len(homes), (reads,), generator=g).tolist()
    expert = torch.randint(homes[0].count, (reads,), generator=g).tolist()
    for h in homes:
        h.open()
    total = sum(homes[i].stride for i in layer)
    t = time.perf_counter()
    list(store.pool.map(lambda le: homes[le[0]]._stored(le[1]) and None, zip(layer, expert)))
    blobs = total / (time.perf_counter() - t)
    if any(h.direct for h in homes):        # direct I/O reads whole blobs only (page-aligned buffers)
        return round(blobs / 1e9, 2)
    stride = max(h.stride for h in homes)
    dest = torch.empty(stride, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = memoryview(dest.numpy())     # every piece lands here: the bytes are not kept, only timed
    calls = [(homes[li], e * homes[li].stride + at, view[at:min(at + PIECE, homes[li].stride)])
             for li, e in zip(layer, expert) for at in range(0, homes[li].stride, PIECE)]
    t = time.perf_counter()
    list(store.pool.map(lambda c: os.preadv(c[0].fd, [c[2]], c[1]), calls))
    pieces = total / (time.perf_counter() - t)
    return round(max(blobs, pieces) / 1e9, 2)


def io_bound(summary: dict, rates: dict) -> float | None:
    """The tok/s a streamed run's bytes a token allow at the rate of the way they moved: disk reads,
    the link read in place (zero-copy), or copies into slots."""
    rate = (rates.get("disk") if summary.get("home") == "disk"
            else rates.get("in_place" if summary.get("zero_copy") else "copy"))
    per = summary.get("bytes_per_token")
    return round(rate * 1e9 / per, 2) if rate and per else None
