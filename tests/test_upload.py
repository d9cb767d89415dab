"""kiln/weights/upload.py: the chunked staging copy gives back every byte (CPU: same logic with
plain buffers and blocking copies; the pinned, overlapped form runs on a GPU only)."""

import pytest
import torch

from kiln.weights.upload import Uploader, pinned_upload_on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_chunked_upload_gives_back_every_byte(dtype):
    up = Uploader("cpu", chunk_bytes=1000, pin=False)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 129, generator=gen), torch.randn(5, generator=gen), torch.randn(3, 400, generator=gen).t()]
    for src in tensors:
        src = src.to(dtype) if dtype.is_floating_point else (src * 50).to(dtype)
        got = up.upload(src, dtype)
        assert got.dtype == dtype and got.shape == src.shape and torch.equal(got, src)
    up.finish()


def test_upload_converts_the_dtype_after_the_copy():
    up = Uploader("cpu", chunk_bytes=256, pin=False)
    src = torch.randn(9, 77, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(up.upload(src, torch.float32), src.float())


def test_pinned_upload_is_opt_in_and_gpu_only(monkeypatch):
    monkeypatch.delenv("KILN_PINNED_UPLOAD", raising=False)
    assert not pinned_upload_on(torch.device("cuda"))
    monkeypatch.setenv("KILN_PINNED_UPLOAD", "1")
    assert pinned_upload_on(torch.device("cuda")) and not pinned_upload_on(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pinned_upload_equals_a_plain_copy():
    up = Uploader("cuda", chunk_bytes=1 << 20)
    srcs = [torch.randn(1000, 777).to(torch.bfloat16) for _ in range(4)]
    got = [up.upload(s, torch.bfloat16) for s in srcs]
    up.finish()
    assert all(torch.equal(g.cpu(), s) for g, s in zip(got, srcs))
