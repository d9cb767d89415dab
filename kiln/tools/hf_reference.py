"""The Hugging Face transformers reference on the same weights kiln runs (for compare and bench).

transformers is a test/benchmark dependency, not a runtime one: importing it is deferred and a
missing install is a clear error.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

from ..errors import KilnError
from ..models import synthesis
from ..weights.synth import parse_spec

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise KilnError("the transformers reference is not installed (pip install 'kiln[test]')") from None
    return transformers


def load_hf_reference(path: str | Path, dtype: str = "f32", device: str = "cpu", attn: str = "eager",
                      plain: bool = True):
    """transformers' causal LM on the checkpoint at `path` (HF folder, GGUF file or `synth:` spec), in
    eval mode. `plain`: the modeling file's own PyTorch code (eager experts loop, no optional kernel
    packages), which is the numerical reference; False keeps what transformers picks (for speed)."""
    tf = transformers_module()
    p = Path(path)
    kw = dict(dtype=DTYPES[dtype], attn_implementation=attn)
    if plain and hasattr(tf.PreTrainedModel, "set_experts_implementation"):
        kw["experts_implementation"] = "eager"  # the loop over experts, not grouped_mm
    if str(path).startswith("synth:"):
        model = _from_synth(tf, str(path), kw)
    elif p.is_file():
        model = tf.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(str(p), **kw)
    if plain:
        _plain_pytorch(sys.modules[type(model).__module__])
    return model.to(device).eval()


def _plain_pytorch(module) -> None:
    """Point the modeling file's kernel-decorated functions (GDN chunk/recurrent rule, causal conv1d)
    back at its own PyTorch bodies: transformers binds flash-linear-attention / causal-conv1d instead
    when they are installed, and those are not the reference (docs/models.md).
    NOTE: this changes the module for the whole process."""
    for name, fn in list(vars(module).items()):
        inner = inspect.unwrap(fn) if inspect.isfunction(fn) else fn
        if inner is not fn and getattr(inner, "__module__", None) == module.__name__:
            params = inspect.signature(inner).parameters
            keep_all = any(q.kind is q.VAR_KEYWORD for q in params.values())

            def plain(*args, _inner=inner, _params=params, _all=keep_all, **kwargs):
                return _inner(*args, **(kwargs if _all else {k: v for k, v in kwargs.items() if k in _params}))

            plain.__wrapped__ = inner
            setattr(module, name, plain)


def _from_synth(tf, spec: str, kw: dict):
    """The synthesized checkpoint's tensors, drawn as kiln draws them, loaded through transformers'
    own `from_pretrained` (meta-device build, weight conversions, tying, buffer init). Strict: any
    missing, unexpected or mis-shaped weight is an error that names it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    s = parse_spec(spec)
    drawn = synthesis(s.name, s.layers, s.seed)
    fields = {k: v for k, v in drawn.config.items() if k != "model_type"}
    config = tf.AutoConfig.for_model(drawn.config["model_type"], **fields)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    state = {name: drawn.tensor(name, kw["dtype"]) for name in drawn.shapes}  # drawn straight into the dtype
    try:
        model, info = cls.from_pretrained(None, config=config, state_dict=state, output_loading_info=True, **kw)
    except RuntimeError as e:  # mis-shaped weights
        raise KilnError(f"{spec}: transformers' {cls.__name__} rejects the synthesized weights: {e}") from None
    bad = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if bad:
        raise KilnError(f"{spec}: the synthesized weights do not match transformers' {cls.__name__}: {bad}")
    return model
