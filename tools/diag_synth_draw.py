"""Where a GPU's quantised synth draw differs from the CPU's (tests/weights/test_synth.py's
test_the_quantised_draw_on_a_gpu_is_the_cpus failed on the H200, 2026-12-05): quantize() of the same
values on both devices, then the draw itself, with the positions of the words that differ.

    PYTHONPATH=. python3 tools/diag_synth_draw.py
"""

from __future__ import annotations

import torch

from kiln.weights import synth
from kiln.weights.quantized import quantize


def differs(name, a, b):
    a, b = a.cpu(), b.cpu()
    bad = (a != b).nonzero()
    print(f"{name}: {bad.shape[0]} of {a.numel()} differ" + (f", first {bad[:6].tolist()}" if bad.numel() else ""))
    return bad.shape[0]


def main():
    synth.BLOCK, synth.DRAW_BATCH = 64 * 40, 3
    name = "model.layers.0.mlp.up_proj.weight"
    drawn = synth.Synthesis(synth.CONFIGS["tiny-llama"], {name: (150, 128)}, False, 3)
    w = drawn.tensor(name, torch.bfloat16)
    for bits, group in ((4, 64), (3, 32), (2, 128)):
        print(f"-- bits {bits} group {group}")
        cpu, gpu = quantize(w, bits, group), quantize(w.cuda(), bits, group)
        differs("quantize packed (gpu vs cpu)", gpu.packed, cpu.packed)
        differs("quantize scales", gpu.scales, cpu.scales)
        got = synth.quantized_draw(drawn, name, (bits, group), torch.bfloat16)
        differs("draw packed (draw vs cpu quantize)", got.packed, cpu.packed)
        differs("draw scales", got.scales, cpu.scales)
        flat = w.float().reshape(-1, group)
        g = flat.cuda()
        w_max, w_min = g.max(-1).values, g.min(-1).values
        c_max, c_min = flat.max(-1).values, flat.min(-1).values
        differs("group max", w_max, c_max)
        differs("group min", w_min, c_min)


if __name__ == "__main__":
    main()
