"""kiln.weights.dequant against the `gguf` package's numpy reference, bit for bit."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import kiln.hub
import kiln.weights.dequant as dq
from kiln.errors import KilnError
from kiln.weights.dequant import SUPPORTED, dequantize, type_name
from kiln.weights.gguf_file import GGUFFile


def reference(raw: np.ndarray, t: int, shape) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T(t)))).reshape(shape)


def assert_bit_exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    assert torch.isfinite(ref).all()  # torch.equal is only a bit-for-bit check without NaNs
    assert torch.equal(ours, ref)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # also tells -0.0 from 0.0


# -- real tensors from the bundled models ---------------------------------------------------------

EXPECTED_TYPES = {
    "smollm2-135m": ["F32", "Q8_0", "Q4_1"],
    "gemma3-270m": ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"],
}


@pytest.fixture(scope="module")
def files():
    return {name: GGUFFile(kiln.hub.ensure(name)) for name in EXPECTED_TYPES}


def test_bundled_files_hold_the_expected_types(files):
    for model, types in EXPECTED_TYPES.items():
        present = {type_name(ti.ggml_type) for ti in files[model].tensors.values()}
        assert present == set(types), model


def pick(f: GGUFFile, tname: str) -> list[str]:
    """Smallest, middle and largest tensor of a type (so token_embd for Q8_0)."""
    infos = sorted((ti for ti in f.tensors.values() if type_name(ti.ggml_type) == tname),
                   key=lambda ti: (ti.nbytes, ti.name))
    idx = sorted({0, len(infos) // 2, len(infos) - 1}) if infos else []
    return [infos[i].name for i in idx]


@pytest.mark.parametrize("model,tname", [(m, t) for m, ts in EXPECTED_TYPES.items() for t in ts])
def test_real_tensors_bit_exact(files, model, tname):
    f = files[model]
    names = pick(f, tname)
    assert len(names) == min(3, sum(type_name(ti.ggml_type) == tname for ti in f.tensors.values()))
    assert names
    if tname == "Q8_0":
        assert "token_embd.weight" in names
    for name in names:
        ti = f.tensors[name]
        raw = f.raw(name)
        assert not raw.flags.writeable  # a read-only memmap slice, as the loader hands it over
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's "non-writable array" warning must not leak
            ours = dequantize(raw, ti.ggml_type, ti.shape)
        assert_bit_exact(ours, reference(raw, ti.ggml_type, ti.shape))
        assert ours.abs().max() > 0, name


def test_at_least_three_real_tensors_per_type(files):
    count: dict[str, int] = {}
    for model, types in EXPECTED_TYPES.items():
        for t in types:
            count[t] = count.get(t, 0) + len(pick(files[model], t))
    assert all(c >= 3 for c in count.values()), count


# -- synthetic data for the other types -----------------------------------------------------------

rng = np.random.default_rng(1234)


def weights(rows: int, cols: int) -> np.ndarray:
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    flat = w.reshape(-1)
    hit = rng.choice(flat.size, size=max(1, flat.size // 997), replace=False)
    flat[hit] *= rng.uniform(5, 40, size=hit.size).astype(np.float32)  # a few outliers
    w[rows // 2, :32] = 0.0  # and an all-zero block
    return w


# offsets of the f16 scale fields inside one block, per type
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


def random_blocks(t: int, n_blocks: int) -> np.ndarray:
    """Random bytes with every f16 scale overwritten by a finite random f16 of either sign."""
    _, tsize = gguf.GGML_QUANT_SIZES[T(t)]
    b = rng.integers(0, 256, size=(n_blocks, tsize), dtype=np.uint8)
    for off in F16_FIELDS[T(t)]:
        v = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 0, n_blocks)).astype(np.float16)
        b[:, off:off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(-1)


def block_of(t: int) -> int:
    return gguf.GGML_QUANT_SIZES[T(t)][0]


def odd_shape(t: int) -> tuple[int, int]:
    """An odd row count and several blocks per row."""
    return (37, 5 * 32) if block_of(t) == 32 else (13, 4 * 256)


@pytest.fixture
def small_chunks(monkeypatch):
    """Decode a few blocks per kernel call, so a tensor spans many chunks and ends in a partial one."""
    monkeypatch.setattr(dq, "_CHUNK_ELEMS", 1000)


QUANTISABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# rough relative RMS error of quantising normal weights with outliers
TOLERANCE = {T.Q4_0: 0.2, T.Q4_1: 0.2, T.Q5_0: 0.1, T.Q5_1: 0.1, T.Q8_0: 0.01, T.BF16: 0.005, T.F16: 0.001}


@pytest.mark.parametrize("t", QUANTISABLE + [T.BF16, T.F16], ids=lambda t: t.name)
def test_quantised_weights_bit_exact(t, small_chunks):
    rows, cols = odd_shape(t)
    w = weights(rows, cols)
    raw = np.ascontiguousarray(gguf.quants.quantize(w, t)).reshape(-1).view(np.uint8)
    ours = dequantize(raw, t, (rows, cols))
    assert_bit_exact(ours, reference(raw, t, (rows, cols)))
    err = torch.linalg.norm(ours - torch.from_numpy(w)) / torch.linalg.norm(torch.from_numpy(w))
    assert err < TOLERANCE[t], float(err)


@pytest.mark.parametrize("t", sorted(F16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_bit_exact(t, small_chunks):
    rows, cols = odd_shape(t)
    nb = rows * cols // block_of(t)
    assert nb > 2 * dq._CHUNK_ELEMS // block_of(t) and nb % (dq._CHUNK_ELEMS // block_of(t))
    raw = random_blocks(t, nb)
    ours = dequantize(raw, t, (rows, cols))
    assert_bit_exact(ours, reference(raw, t, (rows, cols)))


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_three_dim_shape(t):
    block = block_of(t)
    shape = (3, 5, 2 * block)
    raw = random_blocks(t, 3 * 5 * 2)
    assert_bit_exact(dequantize(raw, t, shape), reference(raw, t, shape))
    assert dequantize(raw, t, list(shape)).shape == shape  # a list works as well


@pytest.mark.parametrize("t", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern(t):
    """All 65536 values, NaNs and infinities included, compared as bits."""
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8)
    ours = dequantize(raw, t, (256, 256))
    ref = reference(raw, t, (256, 256))
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    assert torch.isnan(ours).sum() == torch.isnan(ref).sum() > 0


def test_f32_is_a_copy():
    w = rng.standard_normal((7, 3)).astype(np.float32)
    raw = w.reshape(-1).view(np.uint8).copy()
    raw.flags.writeable = False
    ours = dequantize(raw, T.F32, (7, 3))
    assert torch.equal(ours, torch.from_numpy(w))
    ours.fill_(1.0)  # must not write into (or crash on) the read-only input
    assert np.array_equal(raw.view(np.float32).reshape(7, 3), w)


def test_q8_k_matches_its_definition(small_chunks):
    """Q8_K: gguf has no dequantizer for it; x = d (f32) * q (int8), the bsums are not used."""
    n = 37
    d = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    q = rng.integers(-128, 128, size=(n, 256), dtype=np.int8)
    bsums = q.reshape(n, 16, 16).astype(np.int16).sum(-1, dtype=np.int16)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 4), q.view(np.uint8), bsums.view(np.uint8)], axis=1)
    assert raw.shape[1] == gguf.GGML_QUANT_SIZES[T.Q8_K][1]
    ours = dequantize(raw.reshape(-1), T.Q8_K, (n, 256))
    assert torch.equal(ours, torch.from_numpy(d[:, None] * q.astype(np.float32)))


# -- API and errors -------------------------------------------------------------------------------

def test_supported_and_names():
    must = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K}
    assert must <= SUPPORTED
    assert all(isinstance(t, int) for t in SUPPORTED)
    for t in SUPPORTED:
        assert type_name(t) == T(t).name
    assert type_name(T.IQ2_XXS) == "IQ2_XXS"
    assert type_name(9999) == "type 9999"


@pytest.mark.parametrize("t", [T.IQ2_XXS, T.Q8_1, T.I32, 9999])
def test_unsupported_type_raises(t):
    with pytest.raises(KilnError, match=type_name(t)):
        dequantize(np.zeros(4096, dtype=np.uint8), t, (32,))


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_wrong_byte_count_raises(t):
    block, tsize = gguf.GGML_QUANT_SIZES[t]
    shape = (3, 2 * block)
    good = np.zeros(3 * 2 * tsize, dtype=np.uint8)
    assert dequantize(good, t, shape).shape == shape
    for bad in (good[:-1], np.zeros(good.size + tsize, dtype=np.uint8), good[:tsize]):
        with pytest.raises(KilnError, match="bytes"):
            dequantize(bad, t, shape)


def test_row_not_a_whole_number_of_blocks_raises():
    with pytest.raises(KilnError, match="block"):
        dequantize(np.zeros(34 * 2, dtype=np.uint8), T.Q8_0, (4, 16))  # two blocks' worth, rows of 16
    with pytest.raises(KilnError, match="block"):
        dequantize(np.zeros(144, dtype=np.uint8), T.Q4_K, (2, 128))
