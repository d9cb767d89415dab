"""Set up once for every test: without a CUDA GPU, kiln's Triton kernels run under Triton's CPU
interpreter. TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports kiln's kernels (pytest loads this file first)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
