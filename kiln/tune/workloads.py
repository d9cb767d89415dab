"""The (op, shape) pairs a model runs, from its config: every projection (each 2-D weight but the
embeddings; projections of one input concatenated as CudaOps runs them: q|k|v, GDN qkv|z|b|a,
gate|up) as a GEMM at the prefill chunk and at decode (the LM head only at one row: prefill keeps
the last token), every RMSNorm at the rows it sees, the final norm fused into the LM head, and the
attention, Gated DeltaNet and MoE shapes.
"""

from __future__ import annotations

from ..models import model_class
from ..models.base import config_from_dict
from .tuner import Workload

PREFILL_CHUNK = 512       # kiln.engine.Engine's default chunk
DECODE_ROWS = 1
DECODE_CONTEXTS = (2048, 32768)   # decode attention is measured at these context buckets
# How each family's RMSNorm scales (kiln.backends.reference.ReferenceOps.rmsnorm); the GDN gated
# norm (`linear_attn.norm`) is an op of its own.
NORM_STYLE = {"llama": "llama", "qwen3": "llama", "gemma3_text": "offset", "gemma4_text": "plain",
              "qwen3_5_text": "offset", "qwen3_5_moe_text": "offset", "qwen3_next": "offset"}
OPS = ("gemm", "rmsnorm", "rmsnorm_gemm", "gdn_prefill", "gdn_decode", "moe", "attention", "attention_decode",
       "qk_rope", "gemm_act", "act_gemm")


def config_workloads(config: dict, m_values=(PREFILL_CHUNK, DECODE_ROWS), ops=OPS) -> list[Workload]:
    cls = model_class(config.get("model_type"))
    return model_workloads(cls, config_from_dict(cls.config_class, config), config["model_type"], m_values, ops)


def model_workloads(cls, cfg, model_type: str, m_values=(PREFILL_CHUNK, DECODE_ROWS), ops=OPS) -> list[Workload]:
    from ..backends.cuda import gemm as G
    from ..backends.cuda import rmsnorm as R
    from ..backends.cuda import rmsnorm_gemm as RG

    shapes = cls.weight_shapes(cfg)
    style = NORM_STYLE.get(model_type, "llama")
    heads = {"q_norm": getattr(cfg, "num_attention_heads", 1), "k_norm": getattr(cfg, "num_key_value_heads", 1)}
    from ..backends.cuda.fuse import projection_groups

    grouped = {n for names in projection_groups(shapes) for n in names}   # run as one concatenated GEMM
    out: list[Workload] = []
    for name, shape in shapes.items():
        if name.endswith("shared_expert_gate.weight"):
            continue        # [1, H]: inside gate_add_kernel (ops.shared_gate_add), no GEMM of its own
        if len(shape) == 2 and "embed" not in name and name not in grouped:
            ms = (DECODE_ROWS,) if name == "lm_head.weight" else m_values
            out += [Workload(G.OP, G.GemmShape(m, shape[0], shape[1])) for m in ms]
        elif len(shape) == 1 and name.endswith("norm.weight") and "linear_attn.norm" not in name:
            per_row = next((h for part, h in heads.items() if f".{part}." in name), 1)
            out += [Workload(R.OP, R.NormShape(m * per_row, shape[0], style)) for m in m_values]
    out += fused_gemm_workloads(shapes, m_values, style, getattr(cls, "fuses_norm_mlp", False))
    out += gemm_act_workloads(cfg, shapes, m_values, style, getattr(cls, "fuses_norm_mlp", False))
    out += mixer_workloads(cfg, shapes, m_values)
    if "lm_head.weight" in shapes and "model.norm.weight" in shapes:
        vocab, hidden = shapes["lm_head.weight"]
        out.append(Workload(RG.OP, RG.NormGemmShape(DECODE_ROWS, vocab, hidden, style)))
    return list(dict.fromkeys(w for w in out if w.op.name in ops))


def mixer_workloads(cfg, shapes: dict, m_values) -> list[Workload]:
    """Gated DeltaNet and MoE shapes, read off the weights (one per distinct shape)."""
    from ..backends.cuda import _optional
    from ..backends.cuda.common import interpreting

    contexts = (64,) if interpreting() else DECODE_CONTEXTS     # the interpreter is slow
    gdn, moe, attn, rope = _optional("gdn"), _optional("moe"), _optional("attention"), _optional("rope")
    out: list[Workload] = []
    if rope is not None and getattr(cfg, "layer_types", None) and hasattr(cfg, "linear_num_key_heads"):
        # Qwen3.5 / Qwen3-Next full attention: q/k norm + partial RoPE + KV append in one kernel
        h, kv, d, r = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
        if _pow2(d) and r % 2 == 0 and 0 < r <= d:
            out += [Workload(rope.OP, rope.RopeShape(m, h, kv, d, r, "offset")) for m in m_values]
    if attn is not None and _plain_attention(cfg) and _pow2(cfg.head_dim):
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if rope is not None and not hasattr(cfg, "linear_num_key_heads"):     # Llama / Qwen3: full rotary
            style = "llama" if any(n.endswith("self_attn.q_norm.weight") for n in shapes) else None
            out += [Workload(rope.OP, rope.RopeShape(m, h, kv, d, d, style)) for m in m_values]
        for m in m_values:
            if m == 1:
                out += [Workload(attn.DECODE_OP, attn.DecodeShape(n, h, kv, d, None, None)) for n in contexts]
            else:
                out.append(Workload(attn.PREFILL_OP, attn.PrefillShape(m, h, kv, d, None, None, 0)))
    for name, shape in shapes.items():
        if gdn is not None and name.endswith("linear_attn.conv1d.weight"):
            hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            if not (_pow2(dk) and _pow2(dv)):
                continue
            out += [Workload(gdn.DECODE if m == 1 else gdn.PREFILL, gdn.GdnShape(m, hk, hv, dk, dv, shape[-1]))
                    for m in m_values]
        elif moe is not None and name.endswith("experts.gate_up_proj"):
            e, two_i, h = shape
            k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts")
            act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation")
            out += [Workload(moe.OP, moe.MoeShape(m, e, k, h, two_i // 2, act)) for m in m_values]
    return out


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _plain_attention(cfg) -> bool:
    """Every attention layer global, one head shape, no softcap (Llama, Qwen3, Qwen3.5): Gemma's sliding
    layers run on ring caches and its global layers differ per layer; they take the defaults."""
    return not hasattr(cfg, "sliding_window") and hasattr(cfg, "num_key_value_heads") and bool(cfg.head_dim)


def gemm_act_workloads(cfg, shapes: dict, m_values, style: str = "llama", norm_mlp: bool = False) -> list[Workload]:
    """Each MLP's gate|up with its activation (kiln/backends/cuda/gemm_act.py), fused or not, and at
    decode the down projection with act(g) * u computed as it loads (act_gemm)."""
    from ..backends.cuda import elementwise as E
    from ..backends.cuda import gemm_act as GA
    from ..backends.cuda import rmsnorm_gemm as RG
    from ..backends.cuda.common import interpreting
    from ..backends.cuda.fuse import projection_groups

    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
    if act not in E.ACTS or interpreting():    # the interpreter: its kernels are tested on their own
        return []
    out = []
    for names in projection_groups(shapes):
        if names[0].endswith("gate_proj.weight") and len(names) == 2:
            n, k = shapes[names[0]]
            out += [Workload(GA.OP, GA.GemmActShape(m, n, k, act)) for m in m_values]
            down = shapes.get(names[0][: -len("gate_proj.weight")] + "down_proj.weight")
            if down is not None and DECODE_ROWS in m_values:     # decode's down projection of act(g) * u
                out.append(Workload(GA.ACT_OP, GA.ActGemmShape(DECODE_ROWS, down[0], down[1], act)))
            if norm_mlp and DECODE_ROWS in m_values:   # gate|up with the add + post-attention norm in the GEMV
                out.append(Workload(RG.OP, RG.NormGemmShape(DECODE_ROWS, 2 * n, k, style, add=True)))
    return out


def fused_gemm_workloads(shapes: dict, m_values, style: str = "llama", norm_first: bool = False) -> list[Workload]:
    """The concatenated projections CudaOps runs as one GEMM (kiln/backends/cuda/fuse.py); with
    norm_first, at decode also a mixer's first projections with the residual add and its input norm
    in the GEMV (Qwen3.5's norm_next)."""
    from ..backends.cuda import gemm as G
    from ..backends.cuda import rmsnorm_gemm as RG
    from ..backends.cuda.common import interpreting
    from ..backends.cuda.fuse import projection_groups

    out = []
    for names in projection_groups(shapes):
        n, k = sum(shapes[x][0] for x in names), shapes[names[0]][1]
        out += [Workload(G.OP, G.GemmShape(m, n, k)) for m in m_values]
        mixer = names[0].endswith(("self_attn.q_proj.weight", "linear_attn.in_proj_qkv.weight"))
        if norm_first and mixer and DECODE_ROWS in m_values and not interpreting():   # (tested on their own)
            out.append(Workload(RG.OP, RG.NormGemmShape(DECODE_ROWS, n, k, style, add=True)))
    return out
