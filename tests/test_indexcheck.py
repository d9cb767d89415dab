"""KILN_CHECK_INDEX's device-side index check: counted by site, clamped, reported at the next sync."""

import pytest
import torch

from kiln import indexcheck


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(indexcheck, "ON", True)
    counts = torch.zeros((len(indexcheck.SITES), 2), dtype=torch.long)
    monkeypatch.setattr(indexcheck, "_counts", {torch.device("cpu"): counts})
    return counts


def test_an_out_of_range_index_is_clamped_counted_and_reported(on):
    idx = torch.tensor([3, 9, 1, -2])
    got = indexcheck.checked(idx, 5, "last_rows")
    assert got.tolist() == [3, 4, 1, 0]
    assert on[indexcheck.SITES.index("last_rows")].tolist() == [2, 9]
    assert on[indexcheck.SITES.index("embed")].tolist() == [0, 0]
    with pytest.raises(RuntimeError, match=r"last_rows: 2 bad \(largest 9\)"):
        indexcheck.report()


def test_indices_in_range_pass_as_they_are(on):
    idx = torch.randint(0, 7, (16,))
    assert torch.equal(indexcheck.checked(idx, 7, "embed"), idx)
    indexcheck.report()             # nothing to say
    assert on.sum() == 0


def test_off_returns_the_same_tensor(monkeypatch):
    monkeypatch.setattr(indexcheck, "ON", False)
    idx = torch.tensor([99])
    assert indexcheck.checked(idx, 5, "embed") is idx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepared_for_cuda_checks_the_tensors_on_cuda_0(monkeypatch):
    """The engine prepares torch.device("cuda"); its tensors say cuda:0: the same counters."""
    monkeypatch.setattr(indexcheck, "ON", True)
    monkeypatch.setattr(indexcheck, "_counts", {})
    indexcheck.prepare(torch.device("cuda"))
    got = indexcheck.checked(torch.tensor([1, 7], device="cuda"), 5, "embed")
    assert got.tolist() == [1, 4]
    with pytest.raises(RuntimeError, match=r"embed: 1 bad \(largest 7\)"):
        indexcheck.report()
