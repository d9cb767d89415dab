"""kiln/weights/upload.py: the chunked staging copy (from a tensor or read from the file) gives back every
byte (CPU: same logic with plain buffers and blocking copies; the pinned, overlapped form runs on a GPU
only)."""

import pytest
import torch

from kiln.weights.upload import Uploader, pinned_upload_on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_chunked_upload_gives_back_every_byte(dtype):
    up = Uploader("cpu", chunk_bytes=1000, pin=False)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 129, generator=gen), torch.randn(5, generator=gen),
               torch.randn(3, 400, generator=gen).t()]
    for src in tensors:
        src = src.to(dtype) if dtype.is_floating_point else (src * 50).to(dtype)
        got = up.upload(src, dtype)
        assert got.dtype == dtype and got.shape == src.shape and torch.equal(got, src)
    up.finish()


def test_upload_converts_the_dtype_after_the_copy():
    up = Uploader("cpu", chunk_bytes=256, pin=False)
    src = torch.randn(9, 77, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(up.upload(src, torch.float32), src.float())


def test_pinned_upload_is_on_for_gpus_unless_turned_off(monkeypatch):
    monkeypatch.delenv("KILN_PINNED_UPLOAD", raising=False)
    assert pinned_upload_on(torch.device("cuda")) and not pinned_upload_on(torch.device("cpu"))
    monkeypatch.setenv("KILN_PINNED_UPLOAD", "0")
    assert not pinned_upload_on(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pinned_upload_equals_a_plain_copy():
    up = Uploader("cuda", chunk_bytes=1 << 20)
    srcs = [torch.randn(1000, 777).to(torch.bfloat16) for _ in range(4)]
    got = [up.upload(s, torch.bfloat16) for s in srcs]
    up.finish()
    assert all(torch.equal(g.cpu(), s) for g, s in zip(got, srcs))


def _checkpoint(tmp_path, tensors: dict):
    from safetensors.torch import save_file

    from kiln.weights.hf import open_hf_dir

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return open_hf_dir(tmp_path)


def _tensors():
    gen = torch.Generator().manual_seed(2)
    return {"a": torch.randn(300, 41, generator=gen).to(torch.bfloat16), "b": torch.randn(7, generator=gen),
            "c": (torch.randn(5, 3, generator=gen) * 9).to(torch.int8), "d": torch.randn(2000, generator=gen).half()}


def test_file_spans_read_back_every_tensor_in_parallel_pieces(tmp_path, monkeypatch):
    import kiln.weights.upload as U

    monkeypatch.setattr(U, "PIECE_BYTES", 64)     # many pieces a chunk: the threads split every read
    ckpt, tensors = _checkpoint(tmp_path, _tensors()), _tensors()
    up = Uploader("cpu", chunk_bytes=1000, pin=False)
    for name, want in tensors.items():
        span = ckpt.locate(name)
        assert span is not None and span.shape == tuple(want.shape) and span.dtype == want.dtype
        got = up.upload_span(span, want.dtype)
        assert torch.equal(got, want), name
    assert torch.equal(up.upload_span(ckpt.locate("a"), torch.float32), tensors["a"].float())
    up.finish()


def test_a_truncated_file_is_an_error_not_garbage(tmp_path):
    from kiln.errors import KilnError

    ckpt = _checkpoint(tmp_path, _tensors())
    span = ckpt.locate("d")
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(span.offset + 10)
    with pytest.raises(KilnError, match="ended early"):
        Uploader("cpu", chunk_bytes=1000, pin=False).upload_span(span, span.dtype)


def test_a_wrapped_loader_disables_locating(tmp_path):
    import dataclasses

    ckpt = _checkpoint(tmp_path, _tensors())
    assert ckpt.locate("a") is not None
    changed = dataclasses.replace(ckpt, loader=lambda n: ckpt.load(n) * 2)   # the bytes are no longer the file's
    assert changed.locate("a") is None
    assert dataclasses.replace(ckpt, shapes=dict(ckpt.shapes)).locate("a") is not None


def test_load_strict_takes_the_file_read_path(tmp_path, monkeypatch):
    import functools

    import kiln.models.base as base
    import kiln.weights.upload as U
    from kiln.models.base import load_strict

    monkeypatch.setenv("KILN_UPLOAD_READ", "1")
    # load_strict (kiln.models.base) uses the names it imported from kiln.weights.upload
    monkeypatch.setattr(base, "pinned_upload_on", lambda device: True)
    monkeypatch.setattr(base, "Uploader", functools.partial(U.Uploader, chunk_bytes=512, pin=False))
    spans = []
    real = U.Uploader.upload_span
    monkeypatch.setattr(U.Uploader, "upload_span", lambda self, s, d: spans.append(s.shape) or real(self, s, d))
    ckpt, tensors = _checkpoint(tmp_path, _tensors()), _tensors()
    got = load_strict(ckpt, {n: tuple(t.shape) for n, t in tensors.items()}, torch.float32, "cpu")
    assert len(spans) == 4 and all(torch.equal(got[n], t.float()) for n, t in tensors.items())
