"""Triton device functions that kernels of other ops call too: the tensor-core product and the serial
split-K arrival. They live apart from gemm.py because an op's shipped tuning choices are keyed on a
hash of its source files (kiln/tune/shipped.py): the GDN and MoE kernels call these, and an edit to
gemm.py's own kernels should not retire their choices."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(acc, a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ b in f32. UPCAST only under the interpreter (its 16-bit dot is wrong)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def last_arrival(count_ptr, idx, SPLIT_K: tl.constexpr):
    """Whether this program is the last of SPLIT_K to arrive at counter idx (serial split-K).
    NOTE: every thread's partials must be visible before the arrival: a barrier, then a release at
    GPU scope; the acquire on the same counter makes all the splits' partials visible to the last."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + idx, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
