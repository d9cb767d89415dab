"""GGUF file -> HF-style config + tensors under HF names, dequantised at load.

llama.cpp's converter renames tensors, permutes llama's Q/K rows for its interleaved RoPE and
stores Gemma's zero-centred norms as `w + 1`. For Qwen3.5 (`qwen35`, `qwen35moe`) it also stores
A_log as -exp(A_log), squeezes the conv1d weights, adds 1 to the norms HF applies as (1 + w), tiles
the Gated DeltaNet's value heads and splits the fused expert stacks into gate and up. Each is undone
here so models see HF layout and names.
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
    "qwen35": {
        "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_beta": "linear_attn.in_proj_b", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
}
# llama.cpp name after "blk.N." -> HF name after "model.layers.N.", where the kind changes too. The
# converter splits HF's fused [E, 2I, H] gate_up stack into gate and up stacks (or, with
# --fuse-gate-up-exps, keeps it whole): both halves map to the one HF tensor, gate first (_JOINED).
_QWEN35_WHOLE = {
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj", "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj", "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_QWEN35_ARCHS = ("qwen35", "qwen35moe")
_LAYER_NAMES["qwen35moe"] = _LAYER_NAMES["qwen35"]
_WHOLE_NAMES = dict.fromkeys(_QWEN35_ARCHS, _QWEN35_WHOLE)
_JOINED = ("ffn_gate_exps", "ffn_up_exps")      # the parts of one HF tensor, in its order
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
    **dict.fromkeys(("expert_count", "expert_used_count", "expert_feed_forward_length",
                     "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                     "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval", "rope.dimension_count",
                     "nextn_predict_layers"), _INT),
    "attention.recurrent_layers": {"array[bool]"},
}
_POSITIVE_INTS = {  # config key -> the metadata it comes from (vocab_size: or the number of tokens)
    "hidden_size": "embedding_length", "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "max_position_embeddings": "context_length", "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window", "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "linear_conv_kernel_dim": "ssm.conv_kernel", "linear_key_head_dim": "ssm.state_size",
    "linear_num_key_heads": "ssm.group_count", "linear_num_value_heads": "ssm.time_step_rank",
    "full_attention_interval": "full_attention_interval",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)(?:\.(weight|bias))?$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")       # any tensor of a block, an MTP head's nextn.* included


def hf_name(arch: str, name: str) -> str | None:
    m = _BLK.match(name)
    if m:
        layer, leaf, kind = m.groups()
        whole = _WHOLE_NAMES.get(arch, {}).get(name.split(".", 2)[2])
        if whole is not None:
            return f"model.layers.{layer}.{whole}"
        table = {**_LAYER_NAMES["common"], **_LAYER_NAMES.get(arch, {})}
        return f"model.layers.{layer}.{table[leaf]}.{kind}" if leaf in table and kind else None
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


def _check_config(cfg: dict, arch: str, tensor_names, mtp: int = 0) -> None:
    """Sizes positive, floats finite, as many layers as the tensors hold (`mtp`: blocks after them that
    hold a multi-token-prediction head): a damaged number fails here, or in load_strict as a shape
    that does not match its tensor, never inside a model's code."""
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
    blocks = {int(m[1]) for m in map(_BLOCK.match, tensor_names) if m}
    if cfg["num_hidden_layers"] + mtp != len(blocks):
        raise _Invalid(f"{arch}.block_count is {cfg['num_hidden_layers'] + mtp}, but the tensors hold {len(blocks)} "
                       "blocks")


def _common_config(meta: dict, arch: str, tensor_names, mtp: int = 0) -> dict:
    heads = _get(meta, arch, "attention.head_count")
    hidden = _get(meta, arch, "embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": _get(meta, arch, "block_count") - mtp,
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
    # an MoE model whose every layer is sparse has no dense FFN to size (the key absent, or 0)
    if f"{arch}.expert_count" not in meta or meta.get(f"{arch}.feed_forward_length"):
        cfg["intermediate_size"] = _get(meta, arch, "feed_forward_length")
    _check_config(cfg, arch, tensor_names, mtp)     # before an architecture builds anything per layer
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


def _qwen35_config(meta: dict, tensor_names, arch: str) -> dict:
    """Qwen3.5 (dense, or with `moe`): the converter writes the GDN's sizes as llama.cpp's SSM keys and
    the layer pattern as which layers are recurrent; blocks past block_count - nextn_predict_layers hold
    the MTP head, which kiln does not run."""
    mtp = meta.get(f"{arch}.nextn_predict_layers", 0)
    if not 0 <= mtp < _get(meta, arch, "block_count"):
        raise _Invalid(f"{arch}.nextn_predict_layers is {mtp}")
    cfg = _common_config(meta, arch, tensor_names, mtp)
    n, d, hv = cfg["num_hidden_layers"], cfg["head_dim"], _get(meta, arch, "ssm.time_step_rank")
    inner, rotary = _get(meta, arch, "ssm.inner_size"), _get(meta, arch, "rope.dimension_count", d)
    if hv < 1 or inner < 1 or inner % hv:
        raise _Invalid(f"{arch}.ssm.inner_size {inner} is not a whole number of {hv} value heads")
    if hv % max(_get(meta, arch, "ssm.group_count"), 1):
        raise _Invalid(f"{arch}.ssm.time_step_rank {hv} is not a multiple of ssm.group_count")
    if not 0 < rotary <= d:
        raise _Invalid(f"{arch}.rope.dimension_count is {rotary} with heads of {d}")
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    interval = _get(meta, arch, "full_attention_interval", 4)
    if recurrent is not None and len(recurrent) < n:
        raise _Invalid(f"{arch}.attention.recurrent_layers names {len(recurrent)} layers, not {n}")
    cfg.update(
        model_type="qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text", hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"], "partial_rotary_factor": rotary / d},
        linear_conv_kernel_dim=_get(meta, arch, "ssm.conv_kernel"),
        linear_key_head_dim=_get(meta, arch, "ssm.state_size"),
        linear_num_key_heads=_get(meta, arch, "ssm.group_count"), linear_num_value_heads=hv,
        linear_value_head_dim=inner // hv, full_attention_interval=interval,
        layer_types=[("linear_attention" if r else "full_attention") for r in recurrent[:n]] if recurrent is not None
        else ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
    )
    if arch == "qwen35moe":
        cfg.update(num_experts=_get(meta, arch, "expert_count"),
                   num_experts_per_tok=_get(meta, arch, "expert_used_count"),
                   moe_intermediate_size=_get(meta, arch, "expert_feed_forward_length"),
                   shared_expert_intermediate_size=_get(meta, arch, "expert_shared_feed_forward_length"),
                   norm_topk_prob=True)     # llama.cpp's qwen35moe always renormalises the top-k weights
    cfg["mtp_num_hidden_layers"] = mtp     # as HF names it: kiln does not run the head
    return cfg


_CONFIGS = {"llama": _llama_config, "gemma3": _gemma3_config,
            "qwen35": lambda meta, names: _qwen35_config(meta, names, "qwen35"),
            "qwen35moe": lambda meta, names: _qwen35_config(meta, names, "qwen35moe")}


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K (HF rotate_half pairs i, i+d/2; ggml pairs 2i, 2i+1)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise KilnError(f"a Q/K projection of {rows} rows does not split into {n_head} heads of pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _grouped(w: torch.Tensor, dim: int, cfg: dict, head_dim: int) -> torch.Tensor:
    """Undo the converter's value-head order along `dim`: it stores Qwen3.5's GDN value heads tiled
    (value head 0 of every key head, then value head 1, ...) for ggml's broadcast; HF groups them by
    key head."""
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], v_heads // k_heads, k_heads, head_dim, *shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def _qwen35_fixup(cfg: dict, name: str, w: torch.Tensor) -> torch.Tensor:
    """One Qwen3.5 tensor from the converter's form to HF's: the value change first, then the heads."""
    leaf, dv = name.rsplit(".", 2)[-2:], cfg["linear_value_head_dim"]
    qk = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]   # in_proj_qkv's and conv1d's q and k rows
    if name.endswith("linear_attn.A_log"):
        w = torch.log(-w.double()).float()          # stored as -exp(A_log); in f64, so within one ulp of it
    elif name.endswith("linear_attn.conv1d.weight"):
        w = w.unsqueeze(1)                          # squeezed from HF's [C, 1, K]
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w - 1                                   # stored as 1 + w; the model adds the 1 back as HF does
    if cfg["linear_num_key_heads"] == cfg["linear_num_value_heads"] or ".linear_attn." not in name:
        return w
    if leaf[0] in ("in_proj_qkv", "conv1d"):        # the value rows follow q and k
        return torch.cat([w[:qk], _grouped(w[qk:], 0, cfg, dv)])
    if leaf[0] == "in_proj_z":
        return _grouped(w, 0, cfg, dv)
    if leaf[0] in ("in_proj_a", "in_proj_b") or leaf[1] in ("A_log", "dt_bias"):
        return _grouped(w, 0, cfg, 1)
    if leaf[0] == "out_proj":
        return _grouped(w, 1, cfg, dv)
    return w


def _fixup(arch: str, cfg: dict, name: str, w: torch.Tensor) -> torch.Tensor:
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        return _unpermute_qk(w, cfg["num_attention_heads"])
    if arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        return _unpermute_qk(w, cfg["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1  # stored as 1 + w; the model adds the 1 back as HF does
    if arch in _QWEN35_ARCHS:
        return _qwen35_fixup(cfg, name, w)
    return w


def _hf_shape(arch: str, name: str, shapes: list[tuple]) -> tuple:
    """The HF shape of a tensor from its parts' GGUF shapes (joined along dim 1, conv1d unsqueezed)."""
    if len(shapes) > 1:
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
    if arch in _QWEN35_ARCHS and name.endswith("linear_attn.conv1d.weight") and len(shapes[0]) == 2:
        return (shapes[0][0], 1, shapes[0][1])
    return shapes[0]


# Qwen3.5 tensors whose fixup is more than an order of rows: a kept quantised tensor cannot take it
_QWEN35_NOT_ROWS = ("norm.weight", "linear_attn.out_proj.weight", "linear_attn.conv1d.weight")


def _keepable(arch: str, canon: str) -> bool:
    return arch not in _QWEN35_ARCHS or not canon.endswith(_QWEN35_NOT_ROWS)


def _row_order(arch: str, cfg: dict, canon: str, rows: int) -> torch.Tensor | None:
    """The fixup of a keepable 2-D tensor as the order its rows are taken in (None: as stored)."""
    if (arch == "llama" and canon.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
            or arch in _QWEN35_ARCHS and ".linear_attn.in_proj_" in canon):
        return _fixup(arch, cfg, canon, torch.arange(rows)[:, None])[:, 0]
    return None


def keep_quantized() -> bool:
    """KILN_KEEP_QUANTIZED=1: GGUF's Q4_0, Q4_1, Q5_0 and Q8_0 tensors load kept quantised (MLX affine
    groups of 32, exact) instead of dequantised. Off by default while the quantised GEMV is slower than
    the 16-bit one (docs/quant.md)."""
    return os.environ.get("KILN_KEEP_QUANTIZED", "0") not in ("", "0")


def _kept(info, order: torch.Tensor | None, f: GGUFFile) -> QuantizedWeight:
    """A 32-block tensor as affine groups of 32, its rows in HF's order."""
    q, scales, biases = affine_parts(f.raw(info.name), info.ggml_type, info.shape)
    if order is not None:
        q, scales, biases = q[order], scales[order], biases[order]
    return QuantizedWeight(pack(q, AFFINE[info.ggml_type][0]), scales, biases, AFFINE[info.ggml_type][0], 32)


def _parts(path, arch: str, cfg: dict, f: GGUFFile) -> dict[str, list[str]]:
    """HF name -> the GGUF tensors it is made of, in order (one, or an expert stack's gate and up
    halves). An MTP head's blocks are left out."""
    parts: dict[str, list[str]] = {}
    layers, mtp = cfg["num_hidden_layers"], cfg.get("mtp_num_hidden_layers", 0)
    for gname in f.tensors:
        block = _BLOCK.match(gname)
        if block and layers <= int(block[1]) < layers + mtp:
            continue
        canon = hf_name(arch, gname)
        if canon is None:
            raise KilnError(f"{path}: unexpected tensor {gname!r} for architecture {arch}")
        parts.setdefault(canon, []).append(gname)
    for canon, names in parts.items():
        leaves = [n.split(".")[2] if _BLOCK.match(n) else n for n in names]
        if len(names) > 1 or leaves[0] in _JOINED:
            if sorted(leaves) != sorted(_JOINED):
                raise KilnError(f"{path}: {canon} is made of {' and '.join(_JOINED)}, found {', '.join(names)}")
            names.sort(key=lambda n: _JOINED.index(n.split(".")[2]))
            if len({f.tensors[n].shape for n in names}) > 1:    # halves of one stack: a sum could still fit
                raise KilnError(f"{path}: {' and '.join(names)} differ in shape")
    return parts


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
        _check_config(cfg, arch, f.tensors.keys(), cfg.get("mtp_num_hidden_layers", 0))  # with what the arch added
    except _Invalid as e:
        raise KilnError(f"{path}: not a valid GGUF file ({e})") from None
    parts = _parts(path, arch, cfg, f)
    shapes = {canon: _hf_shape(arch, canon, [f.tensors[g].shape for g in names]) for canon, names in parts.items()}

    def part(canon: str, info) -> torch.Tensor:
        if (keep and info.ggml_type in AFFINE and len(info.shape) == 2 and len(parts[canon]) == 1
                and _keepable(arch, canon)):
            return _kept(info, _row_order(arch, cfg, canon, info.shape[0]), f)
        return dequantize(f.raw(info.name), info.ggml_type, info.shape)

    def load(canon: str) -> torch.Tensor:
        ws = [part(canon, f.tensors[g]) for g in parts[canon]]
        if isinstance(ws[0], QuantizedWeight):
            return ws[0]
        return _fixup(arch, cfg, canon, ws[0] if len(ws) == 1 else torch.cat(ws, dim=1))

    eos = meta.get("tokenizer.ggml.eos_token_id")
    generation = {"eos_token_id": [i for i in (eos, meta.get("tokenizer.ggml.eot_token_id")) if i is not None]}
    return Checkpoint(f.path, "gguf", cfg, shapes, load, generation, gguf_metadata=meta)
