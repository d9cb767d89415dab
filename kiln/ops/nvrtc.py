"""CUDA C kernels compiled at load by NVRTC and launched on torch's current stream through the
driver API, for what Triton cannot express (the design allows "CUDA C compiled at load"): such a
kernel is a variant of an op like any other, checked against the trusted one and timed by the tuner.

The libraries are found at first use (ctypes; no new dependency): NVRTC from the CUDA toolkit or the
nvidia-cuda-nvrtc wheel that torch's CUDA builds install, the driver from libcuda. Where either is
missing, `available()` is False and the ops do not offer their CUDA C forms. Compiled kernels
(cubins) are cached on disk, keyed on the source, the options, the GPU architecture and NVRTC's
version; a launch inside a CUDA graph capture is captured like any other kernel.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

from ..fsutil import cache_dir, write_atomic


class NvrtcError(RuntimeError):
    """A CUDA C kernel that does not compile or launch (its first log line)."""


_LIBS: dict[str, object] = {}
_LOCK = threading.Lock()


def _nvrtc_candidates() -> list[str]:
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    dirs = [os.path.join(p, "nvidia") for p in sys.path if p] + [os.path.dirname(torch.__file__) + "/lib"]
    found = []
    for d in dirs:
        found += sorted(glob.glob(os.path.join(d, "*", "lib", "libnvrtc.so*")), reverse=True)
        found += sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), reverse=True)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    return names + [f for f in found if "builtins" not in f and ".alt." not in f]


def _lib(kind: str):
    """The loaded library ("nvrtc" or "cuda"), or None where it cannot be loaded (tried once)."""
    with _LOCK:
        if kind not in _LIBS:
            names = _nvrtc_candidates() if kind == "nvrtc" else ["libcuda.so.1", "libcuda.so"]
            _LIBS[kind] = None
            for name in names:
                try:
                    _LIBS[kind] = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
        return _LIBS[kind]


def compiler_available() -> bool:
    """Whether NVRTC loads here (a CPU machine may have it: the kernels compile, nothing launches)."""
    return _lib("nvrtc") is not None


def available(device: torch.device | None = None) -> bool:
    """Whether CUDA C kernels compile and launch on `device` (or any CUDA device); KILN_CUDA_C=0: never
    (the Triton forms alone, to compare)."""
    if (device is not None and device.type != "cuda") or os.environ.get("KILN_CUDA_C", "1") == "0":
        return False
    return torch.cuda.is_available() and compiler_available() and _lib("cuda") is not None


def kernels_run(dev) -> bool:
    """Whether kiln's CUDA C kernels are offered on `dev` (a tuner DeviceInfo): available here, not
    under Triton's interpreter, and sm_90 or later (they wait with griddepcontrol, Hopper's PDL)."""
    from ..tune.device import interpreting
    return (dev.capability is not None and tuple(dev.capability) >= (9, 0) and not interpreting()
            and available(dev.device))


def nvrtc_version() -> str:
    lib = _lib("nvrtc")
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    if lib is None or lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return "none"
    return f"{major.value}.{minor.value}"


def _check(code: int, what: str, prog=None) -> None:
    if code == 0:
        return
    lib = _lib("nvrtc")
    log = ""
    if prog is not None:
        size = ctypes.c_size_t(0)
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        lines = [ln for ln in buf.value.decode(errors="replace").splitlines() if "error" in ln] or [""]
        log = lines[0].strip()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    raise NvrtcError(f"nvrtc {what}: {lib.nvrtcGetErrorString(code).decode()}" + (f": {log}" if log else ""))


def compile_cubin(source: str, name: str, defines: dict, arch: tuple[int, int]) -> bytes:
    """The cubin of `source` for sm_<arch> with -D defines, from the disk cache or NVRTC."""
    opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}", "-default-device", "-std=c++17"]
    opts += [f"-D{k}={int(v)}" for k, v in sorted(defines.items())]
    tag = hashlib.sha256("\0".join([source, name, nvrtc_version(), *opts]).encode()).hexdigest()[:20]
    path = cache_dir() / "cuda_kernels" / f"{name}_{tag}.cubin"
    if path.exists():
        return path.read_bytes()
    lib = _lib("nvrtc")
    if lib is None:
        raise NvrtcError("nvrtc: no libnvrtc on this machine")
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
           "create")
    try:
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        _check(lib.nvrtcCompileProgram(prog, len(opts), arr), f"compile {name}", prog)
        size = ctypes.c_size_t(0)
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
        cubin = buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: f.write(cubin))      # complete before another process can read it
    return cubin


def _cu(code: int, what: str) -> None:
    if code != 0:
        lib = _lib("cuda")
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(msg))
        raise NvrtcError(f"cuda {what}: {(msg.value or b'?').decode()} ({code})")


def _current_context(index: int) -> None:
    """Make device `index`'s primary context (torch's) current on this thread if none is: a thread
    that has not touched CUDA through the runtime has none."""
    lib = _lib("cuda")
    ctx = ctypes.c_void_p()
    _cu(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "current context")
    if not ctx.value:
        dev = ctypes.c_int()
        _cu(lib.cuDeviceGet(ctypes.byref(dev), index), "device")
        _cu(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "primary context")
        _cu(lib.cuCtxSetCurrent(ctx), "set context")


class _Attr(ctypes.Structure):       # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):     # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("count", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Kernel:
    """One compiled kernel: `kernel(grid, block, args, pdl)` launches it on torch's current stream of
    the args' device. Args are tensors (their data pointers), Python ints (32-bit) and floats (f32)."""

    def __init__(self, source: str, name: str, defines: dict):
        self.source, self.name, self.defines = source, name, dict(defines)
        self._funcs: dict[int, ctypes.c_void_p] = {}

    def function(self, device: torch.device) -> ctypes.c_void_p:
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._funcs.get(index)
        if fn is None:
            arch = torch.cuda.get_device_capability(index)
            cubin = compile_cubin(self.source, self.name, self.defines, arch)
            lib = _lib("cuda")
            with torch.cuda.device(index):
                _current_context(index)
                module, fn = ctypes.c_void_p(), ctypes.c_void_p()
                _cu(lib.cuModuleLoadData(ctypes.byref(module), cubin), f"load {self.name}")
                _cu(lib.cuModuleGetFunction(ctypes.byref(fn), module, self.name.encode()), f"find {self.name}")
            self._funcs[index] = fn
        return fn

    def __call__(self, grid: tuple, block: int, args: list, pdl: bool = False) -> None:
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = self.function(dev)
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else
                ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(int(a)) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
        if not pdl:
            _cu(_lib("cuda").cuLaunchKernel(fn, gx, gy, gz, block, 1, 1, 0, stream, params, None),
                f"launch {self.name}")
            return
        # programmatic dependent launch, as Triton's launch_pdl: the kernel may start while the one
        # before finishes; it waits (griddepcontrol.wait) before reading that one's outputs
        attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = _Config(gx, gy, gz, block, 1, 1, 0, stream, ctypes.pointer(attr), 1)
        _cu(_lib("cuda").cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), f"launch {self.name}")


def source_path(name: str) -> Path:
    """A kernel source shipped beside the ops (kiln/ops/<family>/<name>.cu)."""
    return Path(__file__).parent / name
