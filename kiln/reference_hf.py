"""The Hugging Face transformers reference on the same weights kiln runs (for compare and bench).

transformers is a test/benchmark dependency, not a runtime one: importing it is deferred and a
missing install is a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import KilnError

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise KilnError("the transformers reference is not installed (pip install 'kiln[test]')") from None
    return transformers


def load_hf_reference(path: str | Path, dtype: str = "f32", device: str = "cpu", attn: str = "eager"):
    """transformers' causal LM on the checkpoint at `path` (HF folder or GGUF file), in eval mode."""
    tf = _transformers()
    p = Path(path)
    kw = dict(dtype=DTYPES[dtype], attn_implementation=attn)
    if p.is_file():
        model = tf.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(str(p), **kw)
    return model.to(device).eval()
