"""The GPU draw's Philox kernel (kiln/weights/philox.py, here under Triton's interpreter) against its
reference, numpy's own Philox generator: the same f32 bits for any key, block size and ragged end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kiln.weights import philox, synth

KEYS = [0, 1, 2 ** 64 - 1, 2 ** 64, 2 ** 128 - 1, 0x0123456789ABCDEF_FEDCBA9876543210]


@pytest.mark.parametrize("block, n", [(8 * philox.TILE * 2 + 13, 3 * (8 * philox.TILE * 2 + 13) - 5),
                                      (37, 37 * 5 + 1), (64, 64)])
def test_the_kernel_draws_numpys_philox_stream(block, n):
    """Blocks past one program's tile, blocks not a multiple of the 8 values a counter gives, a short
    last block; keys at the edges of both 64-bit words; then v * scale + shift in f32, two roundings."""
    rng = np.random.default_rng(block)
    keys = [int(k) for k in rng.choice(np.array(KEYS, dtype=object), size=-(-n // block))]
    keys[0] = int.from_bytes(rng.bytes(16), "little")
    scale, shift = np.float32(0.3), np.float32(-0.15)
    got = philox.uniform(keys, torch.empty(n), block, scale, shift).numpy()
    for i, key in enumerate(keys):
        m = min(block, n - i * block)
        want = philox.reference(key, m) * scale + shift
        assert want.dtype == np.float32 and np.array_equal(got[i * block:i * block + m], want), i


def test_the_stream_is_numpys_philox_cut_nowhere():
    """reference() is one generator's stream: drawn in pieces, as the CPU draw fills a block, it is the same."""
    key = 2 ** 100 + 7
    gen = np.random.Generator(np.random.Philox(key=key))
    pieces = np.concatenate([gen.random(k, dtype=np.float32) for k in (6, 1000, 3)])
    assert np.array_equal(pieces, philox.reference(key, 1009))


def test_values_that_do_not_fill_the_blocks_are_refused():
    with pytest.raises(ValueError, match="do not fill"):
        philox.uniform([1, 2], torch.empty(200), 64, 1.0, 0.0)
    with pytest.raises(ValueError, match="do not fill"):
        philox.uniform([1, 2], torch.empty(64), 64, 1.0, 0.0)


def test_a_tensor_drawn_by_the_kernel_is_the_cpu_draw(monkeypatch):
    """synth's GPU trips (here the kernel on the CPU): every trip's values are the CPU blocks' bits,
    the router's skew scaling included, across trips of several blocks and a short last one."""
    monkeypatch.setattr(synth, "BLOCK", 1000)
    monkeypatch.setattr(synth, "DRAW_BATCH", 3)
    cfg = synth.CONFIGS["tiny-qwen3.5-moe"]
    for name, shape in (("model.layers.0.mlp.up_proj.weight", (90, 64)),
                        ("model.layers.0.mlp.gate.weight", (12, 640))):
        drawn = synth.Synthesis(cfg, {name: shape}, False, 5, skew=1.0)
        router = synth.router_scales(name, shape, 5, 1.0)
        assert (router is None) == ("up_proj" in name)
        trips = list(synth._kernel_trips(drawn, name, router, "cpu"))
        n = math.prod(shape)
        assert [t.numel() for t in trips] == [min(3000, n - i) for i in range(0, n, 3000)]
        assert torch.equal(torch.cat(trips), drawn.tensor(name).flatten())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_draws_numpys_philox_stream():
    """On the GPU (uint64 products and constants past 2^63 compiled, not interpreted): synth's own
    block size, three blocks, a short last one."""
    keys = [synth._key(0, "model.layers.0.mlp.experts.gate_up_proj", i) for i in range(3)]
    block, n = synth.BLOCK, 3 * synth.BLOCK - 1001
    got = philox.uniform(keys, torch.empty(n, device="cuda"), block, 2.0, -1.0).cpu().numpy()
    for i, key in enumerate(keys):
        m = min(block, n - i * block)
        want = philox.reference(key, m) * np.float32(2.0) + np.float32(-1.0)
        assert np.array_equal(got[i * block:i * block + m], want), i
