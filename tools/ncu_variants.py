"""Run named variants of one tuned op at one shape, each inside an NVTX range "measure", for Nsight Compute.

    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python3 tools/ncu_variants.py gemm rows=512,n=1024,k=3584 cublas bm128_bn64_bk64_w4_s4_sk2
    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section WarpStateStats \\
        python3 tools/ncu_variants.py gdn_decode rows=1,hk=16,hv=16,dk=128,dv=128,k=4 fused_bv128_w4 fused_bv16_w4

SHAPE gives the fields of the op's shape dataclass (kiln.ops.<family>.kernels; `kiln tune` prints the
variant names). `cublas` (gemm only) is torch.matmul into the same output, the peer. Each variant runs
three times, then once inside the range, so ncu reports one warm launch of each (its kernels appear in
the order given; the "ran" lines say which, with each output's max abs difference from the op's
trusted variant). On CPU, under TRITON_INTERPRET=1, each runs once (a smoke
run). `--list` prints the op's catalogue for the shape instead.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch


def field_value(text: str):
    """A shape field's value: an int, a float, None, a bool, or the text itself (a style, an act)."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def parse_shape(op, text: str):
    fields = {f.name for f in dataclasses.fields(op.shape_type)}
    given = dict(part.split("=", 1) for part in text.split(",") if part)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise SystemExit(f"{op.name} shapes have no field {unknown[0]} (fields: {', '.join(sorted(fields))})")
    return op.shape_type(**{k: field_value(v) for k, v in given.items()})


def runner(op, name: str, shape, dev, inputs: dict, outputs: dict):
    from kiln.tune.registry import catalogue

    if name == "cublas" and op.name == "gemm":
        x, w = inputs["x"], inputs["w"]
        return lambda: torch.matmul(x, w.t(), out=outputs["y"])
    forms = [op.trusted(shape, dev)] + catalogue(op, shape, dev)
    v = next((v for v in forms if v.name == name), None)
    if v is None:
        raise SystemExit(f"no {op.name} variant named {name} for {op.shape_str(shape)} (--list shows them)")
    return lambda: op.run(v, inputs, outputs, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("op", help="a tuned op: gemm, gdn_decode, attention_decode, ...")
    ap.add_argument("shape", help="FIELD=VALUE,... of the op's shape")
    ap.add_argument("variants", nargs="*", help="variant names (and cublas for gemm)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--list", action="store_true", help="print the op's variants for the shape and exit")
    a = ap.parse_args()

    import kiln.backends.cuda  # noqa: F401  (imports every kernel family: each registers its ops)
    from kiln.tune.device import device_info
    from kiln.tune.registry import catalogue, get_op

    op = get_op(a.op)
    shape = parse_shape(op, a.shape)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dev = device_info(device)
    if a.list:
        print("\n".join(dict.fromkeys([op.trusted(shape, dev).name] + [v.name for v in catalogue(op, shape, dev)])))
        return
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    inputs = op.inputs(shape, dtype, device, torch.Generator(device=device).manual_seed(0))
    want = op.outputs(shape, inputs)
    op.run(op.trusted(shape, dev), inputs, want, None)
    outputs = op.outputs(shape, inputs)
    for name in a.variants:
        run = runner(op, name, shape, dev, inputs, outputs)
        for _ in range(3 if cuda else 1):
            run()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        diff = ", ".join(f"{k} {(outputs[k].float() - w.float()).abs().max().item():.3g}"
                         for k, w in want.items() if w.is_floating_point())
        print(f"ran {name} (max abs difference from trusted: {diff})", flush=True)


if __name__ == "__main__":
    main()
