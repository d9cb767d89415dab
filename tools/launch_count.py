"""Kernel launches of one decode step, by kernel, on the CPU (no GPU).

    TRITON_INTERPRET=1 python3 tools/launch_count.py MODEL [MODEL ...] [--prompt 4] [--json OUT]

Loads each MODEL on the cuda backend on the CPU (Triton's interpreter runs the kernels; each op's
default variant, KILN_TUNE_BUDGET_S=0), prefills a short prompt, then counts what one eager decode
step launches: every Triton kernel by name, and every torch op that would launch a CUDA kernel
(views, allocations and metadata excluded). A GPU's captured step launches the same kernels, but the
tuner there may pick forms with other launch counts (a split GEMV's reduction), and shapes too small
for a kernel fall back to torch ops here: compare two structures at real widths (a real config with
`:layers=2`, e.g. bf16 against 4-bit), not absolute counts; kiln bench's launches_per_token is the
GPU's figure. The LM head's GEMV under the interpreter takes a while (seconds to a minute)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KILN_TUNE_BUDGET_S", "0")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_KERNEL = {   # torch ops that launch nothing on a GPU: views, allocation, metadata, host scalars
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "alias", "detach", "detach_", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
    "lift_fresh", "view_as_real", "view_as_complex", "unfold", "diagonal", "_reshape_alias", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "numel", "is_contiguous",
    "set_", "resize_", "movedim", "flatten", "unflatten", "view_as", "expand_as", "promote_types",
    "is_pinned", "_has_compatible_shallow_copy_type", "result_type",
}


class Counting(TorchDispatchMode):
    """Counts torch ops run outside a Triton launch (the interpreter's own copies are not launches)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_triton(mode: Counting) -> tuple[Counter, object]:
    """The interpreter's launch patched to count kernels by name; (the counter, the original)."""
    from triton.runtime import interpreter

    kernels: Counter = Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        kernels[self.fn.__name__] += 1
        mode.inside += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            mode.inside -= 1

    interpreter.InterpretedFunction.run = counted
    return kernels, run


def measure(model: str, prompt: int) -> dict:
    from triton.runtime import interpreter

    import kiln
    from kiln.weights.synth import random_prompt

    llm = kiln.load(model, device="cpu", backend="cuda", dtype="bf16", max_context=prompt + 8)
    eng = llm.engine
    state = eng.new_state(prompt + 2)
    tok = int(torch.argmax(eng.prefill(random_prompt(prompt, llm.model.cfg.vocab_size, 0), state)))
    mode = Counting()
    kernels, run = count_triton(mode)
    try:
        with mode:
            eng.decode_step(tok, prompt, state)
    finally:
        interpreter.InterpretedFunction.run = run
    out = {"triton": dict(kernels.most_common()), "torch": dict(mode.ops.most_common()),
           "layers": llm.model.cfg.num_hidden_layers}
    out["launches"] = sum(out["triton"].values()) + sum(out["torch"].values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompt", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = {}
    for m in a.models:
        out[m] = r = measure(m, a.prompt)
        print(f"{m}: {r['launches']} launches in a decode step ({r['layers']} layers)")
        for kind in ("triton", "torch"):
            for name, c in r[kind].items():
                print(f"  {kind:6} {c:4d}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
