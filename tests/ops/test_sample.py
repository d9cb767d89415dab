"""The device-side greedy choice (kiln.ops.sample.kernels.greedy_next) against torch.argmax on
fresh random logits of ragged vocabularies, with ties across programs, all -inf and NaN. Under
Triton's interpreter on CPU; the `gpu` test runs a 248,320 vocabulary (Qwen3.5's) on the device.
(The pipelined greedy loop that feeds on it: tests/backends/test_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops.sample import kernels as sample_kernels  # noqa: E402
from kiln.ops.sample.reference import greedy_next_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(logits: torch.Tensor) -> tuple[int, int]:
    ids = torch.full((1,), -1, dtype=torch.long, device=DEVICE)
    pos = torch.full((1,), 41, dtype=torch.long, device=DEVICE)
    sample_kernels.greedy_next(logits, ids, pos)
    return int(ids), int(pos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 5, 2048, 2049, 6001, 20000])
def test_greedy_next_is_torch_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    for _ in range(2):        # twice: the arrival counter resets itself
        logits = (torch.randn(vocab, generator=g) * 4).to(dtype=dtype, device=DEVICE)
        assert run(logits) == (int(torch.argmax(logits)), 42)


def test_greedy_next_ties_go_to_the_lowest_index():
    g = torch.Generator().manual_seed(1)
    for where in ([17, 19], [3000, 9], [19999, 10001, 14000], [4096, 2048]):
        logits = torch.randn(20000, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
        logits[where] = 9.0
        assert run(logits)[0] == min(where) == int(torch.argmax(logits))


def test_greedy_next_all_minus_inf_and_nan():
    logits = torch.full((5000,), float("-inf"), device=DEVICE)
    assert run(logits)[0] == int(torch.argmax(logits)) == 0
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[[4000, 3999]] = float("nan")
    ids, pos = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    greedy_next_reference(logits, ids, pos)
    assert run(logits)[0] == int(ids) == 3999      # NaN as +inf: the first NaN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_next_at_qwen35_vocabulary():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = (torch.randn(248320, generator=g) * 3).to(device=DEVICE, dtype=torch.bfloat16)
        assert run(logits) == (int(torch.argmax(logits)), 42)
