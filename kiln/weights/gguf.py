"""GGUF file -> HF-style config + tensors under HF names, dequantised at load.

llama.cpp's converter renames tensors, permutes llama's Q/K rows for its interleaved RoPE and
stores Gemma's zero-centred norms as `w + 1`; each is undone here so models see HF layout.
"""

from __future__ import annotations

import math
import os
import re

import torch

from ..errors import KilnError
from .checkpoint import Checkpoint
from .dequant import AFFINE, affine_parts, dequantize
from .gguf_file import INT_TYPES, GGUFFile
from .quantized import QuantizedWeight, pack

_LAYER_NAMES = {  # llama.cpp leaf -> HF leaf, per architecture
    "common": {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_INT, _NUM, _STR = INT_TYPES, INT_TYPES | {"f32", "f64"}, frozenset({"str"})
# The metadata kiln reads -> the GGUF types it may be stored as (`GGUFFile.value_types`). Another
# type is damage, and a value of it would fail far from here or silently mean something else.
_KEY_TYPES = {
    "general.architecture": _STR, "tokenizer.ggml.model": _STR, "tokenizer.ggml.pre": _STR,
    "tokenizer.chat_template": _STR, "tokenizer.ggml.tokens": {"array[str]"}, "tokenizer.ggml.merges": {"array[str]"},
    "tokenizer.ggml.scores": {f"array[{t}]" for t in _NUM}, "tokenizer.ggml.token_type": {f"array[{t}]" for t in _INT},
    **{f"tokenizer.ggml.{k}_token_id": _INT for k in ("bos", "eos", "eot", "eom", "unknown", "padding")},
}
_ARCH_KEY_TYPES = {  # under "{arch}."
    **dict.fromkeys(("block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
                     "attention.head_count", "attention.head_count_kv", "attention.key_length",
                     "attention.sliding_window"), _INT),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"), _NUM),
    "rope.scaling.type": _STR,
}
_POSITIVE_INTS = {  # config key -> the metadata it comes from (vocab_size: or the number of tokens)
    "hidden_size": "embedding_length", "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "max_position_embeddings": "context_length", "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(arch: str, name: str) -> str | None:
    m = _BLK.match(name)
    if m:
        layer, leaf, kind = m.groups()
        table = {**_LAYER_NAMES["common"], **_LAYER_NAMES.get(arch, {})}
        return f"model.layers.{layer}.{table[leaf]}.{kind}" if leaf in table else None
    stem, _, kind = name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


class _Invalid(Exception):
    """Metadata that parses but cannot be right; open_gguf raises it as KilnError with the path."""


def _get(meta: dict, arch: str, key: str, default=None):
    v = meta.get(f"{arch}.{key}", default)
    if v is None:
        raise KilnError(f"GGUF metadata lacks {arch}.{key}")
    return v


def _check_types(f: GGUFFile, arch: str) -> None:
    expected = {**_KEY_TYPES, **{f"{arch}.{k}": types for k, types in _ARCH_KEY_TYPES.items()}}
    for key, vtype in f.value_types.items():
        types = _STR if key.startswith("tokenizer.chat_template.") else expected.get(key)
        if types is not None and vtype not in types:
            raise _Invalid(f"metadata {key} is stored as {vtype}, not {' or '.join(sorted(types))}")


def _check_config(cfg: dict, arch: str, tensor_names) -> None:
    """Sizes positive, floats finite, as many layers as the tensors hold: a damaged number fails here,
    or in load_strict as a shape that does not match its tensor, never inside a model's code."""
    for key, gguf_key in _POSITIVE_INTS.items():
        if key in cfg and cfg[key] < 1:
            raise _Invalid(f"{arch}.{gguf_key} is {cfg[key]}")
    for key, gguf_key, least in (("rms_norm_eps", "attention.layer_norm_rms_epsilon", 0.0),
                                 ("rope_theta", "rope.freq_base", math.ulp(0.0))):
        if not math.isfinite(cfg[key]) or cfg[key] < least:
            raise _Invalid(f"{arch}.{gguf_key} is {cfg[key]}")
    factor = cfg.get("rope_scaling", {}).get("factor", 1.0)     # where an architecture sets one
    if not math.isfinite(factor) or factor <= 0:
        raise _Invalid(f"{arch}.rope.scaling.factor is {factor}")
    blocks = {int(m[1]) for m in map(_BLK.match, tensor_names) if m}
    if cfg["num_hidden_layers"] != len(blocks):
        raise _Invalid(f"{arch}.block_count is {cfg['num_hidden_layers']}, but the tensors hold {len(blocks)} blocks")


def _common_config(meta: dict, arch: str, tensor_names) -> dict:
    heads = _get(meta, arch, "attention.head_count")
    hidden = _get(meta, arch, "embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": _get(meta, arch, "block_count"),
        "intermediate_size": _get(meta, arch, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _get(meta, arch, "attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // max(heads, 1)),
        "rms_norm_eps": _get(meta, arch, "attention.layer_norm_rms_epsilon"),
        "rope_theta": _get(meta, arch, "rope.freq_base", 10000.0),
        "max_position_embeddings": _get(meta, arch, "context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    _check_config(cfg, arch, tensor_names)     # before an architecture builds anything per layer
    return cfg


def _llama_config(meta: dict, tensor_names) -> dict:
    cfg = _common_config(meta, "llama", tensor_names)
    cfg.update(model_type="llama", hidden_act="silu")
    return cfg


def _gemma3_config(meta: dict, tensor_names) -> dict:
    cfg = _common_config(meta, "gemma3", tensor_names)
    n = cfg["num_hidden_layers"]
    cfg.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=cfg["head_dim"],
        sliding_window=_get(meta, "gemma3", "attention.sliding_window"),
        rope_local_base_freq=10000.0,  # llama.cpp hard-codes the local base for gemma3
        # every 6th layer is global (Gemma 3's 5:1 pattern)
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
    )
    factor = meta.get("gemma3.rope.scaling.factor")
    if factor and meta.get("gemma3.rope.scaling.type", "linear") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return cfg


_CONFIGS = {"llama": _llama_config, "gemma3": _gemma3_config}


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K (HF rotate_half pairs i, i+d/2; ggml pairs 2i, 2i+1)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise KilnError(f"a Q/K projection of {rows} rows does not split into {n_head} heads of pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _fixup(arch: str, cfg: dict, name: str, w: torch.Tensor) -> torch.Tensor:
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return _unpermute_qk(w, cfg["num_attention_heads"])
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return _unpermute_qk(w, cfg["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1  # stored as 1 + w; the model adds the 1 back as HF does
    return w


def keep_quantized() -> bool:
    """KILN_KEEP_QUANTIZED=1: GGUF's Q4_0, Q4_1, Q5_0 and Q8_0 tensors load kept quantised (MLX affine
    groups of 32, exact) instead of dequantised. Off by default while the quantised GEMV is slower than
    the 16-bit one (docs/quant.md)."""
    return os.environ.get("KILN_KEEP_QUANTIZED", "0") not in ("", "0")


def _kept(arch: str, cfg: dict, canon: str, info, f: GGUFFile) -> QuantizedWeight:
    """A 32-block tensor as affine groups of 32, its rows in HF's order (llama's Q/K unpermuted)."""
    q, scales, biases = affine_parts(f.raw(info.name), info.ggml_type, info.shape)
    if arch == "llama" and canon.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in canon else cfg["num_key_value_heads"]
        order = _unpermute_qk(torch.arange(q.shape[0])[:, None], heads)[:, 0]
        q, scales, biases = q[order], scales[order], biases[order]
    return QuantizedWeight(pack(q, AFFINE[info.ggml_type][0]), scales, biases, AFFINE[info.ggml_type][0], 32)


def open_gguf(path, keep: bool | None = None) -> Checkpoint:
    """A GGUF file as a checkpoint; `keep` (default: KILN_KEEP_QUANTIZED) keeps its 32-block tensors
    quantised."""
    keep = keep_quantized() if keep is None else keep
    f = GGUFFile(path)
    meta = f.metadata
    arch = meta.get("general.architecture")
    try:
        _check_types(f, arch if isinstance(arch, str) else "")
        if arch not in _CONFIGS:
            raise KilnError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(_CONFIGS)})")
        cfg = _CONFIGS[arch](meta, f.tensors.keys())
        _check_config(cfg, arch, f.tensors.keys())     # again, with what the architecture added
    except _Invalid as e:
        raise KilnError(f"{path}: not a valid GGUF file ({e})") from None
    names, shapes = {}, {}
    for gname, info in f.tensors.items():
        canon = hf_name(arch, gname)
        if canon is None:
            raise KilnError(f"{path}: unexpected tensor {gname!r} for architecture {arch}")
        names[canon], shapes[canon] = gname, info.shape

    def load(canon: str) -> torch.Tensor:
        info = f.tensors[names[canon]]
        if keep and info.ggml_type in AFFINE and len(info.shape) == 2:
            return _kept(arch, cfg, canon, info, f)
        w = dequantize(f.raw(info.name), info.ggml_type, info.shape)
        return _fixup(arch, cfg, canon, w)

    eos = meta.get("tokenizer.ggml.eos_token_id")
    generation = {"eos_token_id": [i for i in (eos, meta.get("tokenizer.ggml.eot_token_id")) if i is not None]}
    return Checkpoint(f.path, "gguf", cfg, shapes, load, generation, gguf_metadata=meta)
