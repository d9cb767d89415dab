"""What a model class declares about itself is what it runs: the packed projections are merged at
load (the parts gone, the merged rows in order), and every tuned op the cuda backend consults while
the model runs a prompt chunk and a decode step is one of the shapes the model declares in
kernel_shapes (so nothing it runs is left untuned). Under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.cuda import CudaOps
from kiln.models import build_model, model_config
from kiln.ops.dispatch import TunedOps
from kiln.tune.registry import REGISTRY
from kiln.weights import open_checkpoint
from kiln.weights.synth import CONFIGS, synth_config

TINY = sorted(n for n in CONFIGS if n.startswith("tiny-"))
# Attention on sliding-window models runs each kernel's default: their layer kinds differ in window
# (and for Gemma 4 in head dim and KV heads), so they declare no attention shapes (their kernel_shapes).
UNDECLARED = {"gemma3_text": {"attention", "attention_decode", "qk_rope"},
              "gemma4_text": {"attention", "attention_decode", "qk_rope"}}


@pytest.mark.parametrize("name", TINY)
def test_packed_weights_are_merged_at_load(name):
    ckpt = open_checkpoint(f"synth:{name}")
    cls, cfg = model_config(ckpt.config)
    model = build_model(ckpt, CudaOps("cpu"), torch.float32, "cpu")
    groups = cls.packed_groups(cfg)
    raw = ckpt.for_model(cls.checkpoint_shapes(cfg), cls.norm_style == "offset")
    assert groups or name.startswith("tiny-gemma4")
    for merged, parts in groups.items():
        assert not set(parts) & model.w.keys(), merged
        want = torch.cat([raw.load(n).float() for n in parts])
        assert torch.equal(model.w[merged], want), merged


@pytest.mark.parametrize("name", TINY)
def test_every_tuned_op_the_forward_consults_is_declared(name, monkeypatch):
    config = synth_config(name)
    cls, cfg = model_config(config)
    ops = CudaOps("cpu")
    rows, contexts = (ops.prefill_chunk, 1), (64,)
    declared = {(ks.op, REGISTRY[ks.op].shape_type(**dict(ks.dims)).key)
                for ks in cls.kernel_shapes(cfg, rows, contexts) if ks.op in REGISTRY}
    asked = set()
    choose = TunedOps.choose
    monkeypatch.setattr(TunedOps, "choose", lambda self, op, shape: asked.add((op.name, shape.key))
                        or choose(self, op, shape))
    model = build_model(open_checkpoint(f"synth:{name}"), ops, torch.float32, "cpu")
    state = model.make_state(torch.float32, "cpu")
    ids = torch.arange(11) % model.cfg.vocab_size
    model.forward(ids, torch.arange(11), state)
    model.forward(ids[:1], torch.tensor([11]), state)
    skip = UNDECLARED.get(config["model_type"], set())
    missing = sorted(k for k in asked - declared if k[0] not in skip)
    assert asked and not missing, f"run but not declared: {missing}"
