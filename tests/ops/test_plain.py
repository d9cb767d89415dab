"""The kernels outside the tuner that a load warms while the weights load (kiln/ops/plain.py): each model
family's list names what its forward launches, and every launch runs (here under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from kiln.models import model_config
from kiln.ops import plain
from kiln.weights.synth import synth_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name,want", [
    ("tiny-qwen3.5", {"greedy", "gdn_unpack", "gdn_unpack_padded"}),
    ("tiny-qwen3.5-moe", {"greedy", "router", "router_linear_topk", "shared_gate", "gated_combine", "gdn_unpack",
                          "gdn_unpack_padded"}),
    ("tiny-gemma4-moe-p2", {"greedy", "gelu_mul_96", "scaled_topk", "router_gemv_topk"}),
])
def test_plain_kernels_listed_and_launch(name, want, monkeypatch):
    monkeypatch.setenv("KILN_ROPE_TABLES", "0")
    _, cfg = model_config(synth_config(name))
    kernels = plain.plain_kernels(cfg, torch.bfloat16, DEVICE)
    assert {n for n, _ in kernels} == want
    for _, launch in kernels:
        launch()


def test_the_rope_tables_are_warmed_where_they_are_on(monkeypatch):
    monkeypatch.setenv("KILN_ROPE_TABLES", "1")
    _, cfg = model_config(synth_config("tiny-gemma4-moe-p2"))
    kernels = dict(plain.plain_kernels(cfg, torch.bfloat16, DEVICE))
    assert "rope_tables" in kernels
    kernels["rope_tables"]()


def test_warm_logs_instead_of_failing(monkeypatch):
    """A warm-up that fails (the list raises; without a GPU, entering the device does first) logs one
    line and ends; the load goes on."""
    lines = []
    monkeypatch.setattr(plain, "plain_kernels", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    plain.warm(None, torch.bfloat16, torch.device("cuda"), log=lines.append).join(timeout=30)
    assert len(lines) == 1 and "plain kernels not warmed" in lines[0]
    assert "boom" in lines[0] or not torch.cuda.is_available()


def test_plain_stand_ins_keep_the_kernels_contracts(monkeypatch):
    """The warm-up launches on stand-ins, on a thread beside the load: combine reads row `rank` of a
    token's k rows, so k equal ids sent it past its k rows (an illegal address on an H100, at random);
    a NaN stand-in sends a top-k's ids out of range. Stand-ins: distinct ids, finite values."""
    seen = []
    real = plain.moe.combine
    monkeypatch.setattr(plain.moe, "combine", lambda y, idx, *a, **kw: (seen.append((y, idx)), real(y, idx, *a, **kw)))
    _, cfg = model_config(synth_config("tiny-qwen3.5-moe"))
    for _, launch in plain.plain_kernels(cfg, torch.bfloat16, DEVICE):
        launch()
    assert len(seen) == 1
    y, idx = seen[0]
    assert all(len(set(row.tolist())) == idx.shape[1] for row in idx)
    assert torch.isfinite(y).all()


def test_the_warm_up_is_joined_before_the_tuner_times(monkeypatch):
    """The warm-up's router and greedy count arrivals in per-device buffers that the tuner's split-K
    candidates use too: the tuner may time only once the warm-up thread is done."""
    from types import SimpleNamespace

    from kiln.backends.cuda import CudaOps

    order = []
    ops = CudaOps(DEVICE)
    ops._warm = SimpleNamespace(join=lambda: order.append("join"))
    ops._tuner = SimpleNamespace(dtype=torch.bfloat16,
                                 tune=lambda wls: (order.append("tune"), (None, SimpleNamespace(hit=True)))[1])
    monkeypatch.setattr(ops, "dense_workloads", lambda *a, **kw: [])
    ops.prepare(SimpleNamespace(cfg=None, w={}), torch.bfloat16)
    assert order == ["join", "tune"] and ops._warm is None
