"""Set up once for every test: without a CUDA GPU, kiln's Triton kernels run under Triton's CPU
interpreter. TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports kiln's kernels (pytest loads this file first)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_lang_once() -> None:
    """Triton's interpreter patches triton.language for each launch (restored when the launch ends) and
    again at every call of a @triton.jit helper inside the kernel, each time walking the language's
    modules with inspect.getmembers (~1 ms): ~40% of an interpreted test's time (cProfile of
    tests/backends/test_cuda.py's logits test, 2026-12-06: 17 of 39 s). While every language module a
    function sees is patched already, patching it again changes nothing: that call takes an empty
    scope. Where Triton's interpreter has another shape, it is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if patch is None or scope is None or is_builtin is None or getattr(patch, "kiln_once", False):
        return

    def patched(lang) -> bool:
        # a builtin replaced by the interpreter's wrapper (tl.math too: patched only through tl)
        return not is_builtin(getattr(lang, "load", None)) and (lang is not tl or not is_builtin(tl.math.exp))

    def once(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and all(patched(lang) for lang in langs):
            return scope()
        return patch(fn)

    once.kiln_once = True
    interpreter._patch_lang = once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_lang_once()
