"""Qwen3.5 text (dense hybrid): Gated DeltaNet layers and gated full-attention layers per
`layer_types`, zero-centred RMSNorm (1 + w), q/k norm, partial rotary, SwiGLU MLP.

Per-layer state: GDNState (conv window + f32 recurrent state) for linear_attention layers,
KVCache for full_attention layers. Qwen3.5-MoE and Qwen3-Next build on this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..cache import GDNState
from ..errors import KilnError
from .base import (
    Model,
    attention_shapes,
    gated_mlp_shapes,
    gemms,
    kernel,
    last_rows,
    lm_head_shapes,
    norms,
    per_request,
)
from .rope import default_scale, inv_freq


@dataclass
class Qwen35Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_parameters: dict | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list = field(default_factory=list)
    full_attention_interval: int = 4
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    # mixture of experts (Qwen3.5-MoE, Qwen3-Next)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)

    def __post_init__(self):
        rp = self.rope_parameters or {}
        self.rope_theta = rp.get("rope_theta", self.rope_theta)
        self.partial_rotary_factor = rp.get("partial_rotary_factor", self.partial_rotary_factor)
        if not self.layer_types:
            n = self.full_attention_interval
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        if self.attention_bias:
            raise KilnError("attention_bias=true is not supported for Qwen3.5 (no released model uses it)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise KilnError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class Qwen35(Model):
    config_class = Qwen35Config
    several_prompts = True   # prompts prefilled together: per_request slices each one's rows
    norm_style = "offset"
    packed = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"),
              "linear_attn.in_proj_qkvzba.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                                    "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    # Each residual add and the norm after it go to the next projections' GEMV (the mixer's input
    # projections, the MLP's gate|up) through one op, which can run them inside it at decode.
    norm_in_next_gemv = True
    projections_later = True    # out_proj, o_proj and the dense MLP's down go through ops.linear_later

    def __init__(self, cfg, weights, ops):
        super().__init__(cfg, weights, ops)
        self.inv_freq = inv_freq(cfg.rotary_dim, cfg.rope_theta).to(ops.device)
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        hk, hv, dk, dv = self.gdn_dims(cfg)
        kv = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_sizes = [2 * cfg.num_attention_heads * cfg.head_dim, kv, kv]
        self.gdn_sizes = [2 * hk * dk + hv * dv, hv * dv, hv, hv]

    @classmethod
    def sanitize(cls, ckpt):
        return undo_mlx_sanitize(ckpt)

    # -- declared weights -------------------------------------------------------------------------
    @classmethod
    def weight_shapes(cls, c):
        h = c.hidden_size
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (c.vocab_size, h)}
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            mixer = cls.gdn_shapes(c) if kind == "linear_attention" else cls.attention_shapes(c)
            shapes.update({p + k: v for k, v in mixer.items()})
            shapes.update({p + k: v for k, v in cls.mlp_shapes(c, i).items()})
        return shapes

    @staticmethod
    def attention_shapes(c):
        d, h = c.head_dim, c.hidden_size
        return {"self_attn.q_proj.weight": (2 * c.num_attention_heads * d, h),
                "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
                "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
                "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
                "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}

    @staticmethod
    def gdn_dims(c):
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        return hk, hv, c.linear_key_head_dim, c.linear_value_head_dim

    @classmethod
    def gdn_shapes(cls, c):
        hk, hv, dk, dv = cls.gdn_dims(c)
        conv = 2 * hk * dk + hv * dv
        p, h = "linear_attn.", c.hidden_size
        return {p + "in_proj_qkv.weight": (conv, h), p + "in_proj_z.weight": (hv * dv, h),
                p + "in_proj_b.weight": (hv, h), p + "in_proj_a.weight": (hv, h),
                p + "conv1d.weight": (conv, 1, c.linear_conv_kernel_dim), p + "dt_bias": (hv,),
                p + "A_log": (hv,), p + "norm.weight": (dv,), p + "out_proj.weight": (h, hv * dv)}

    @classmethod
    def mlp_shapes(cls, c, layer: int):
        h, f = c.hidden_size, c.intermediate_size
        return {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}

    @classmethod
    def kernel_shapes(cls, c, rows, contexts):
        h, d, heads, kv, style = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, cls.norm_style
        out = norms(rows, h, style)
        if "full_attention" in c.layer_types:
            out += cls.mixer_shapes(rows, (2 * heads + 2 * kv) * d, h, (h, heads * d))
            out += norms(rows, d, style, per_row=heads) + norms(rows, d, style, per_row=kv)
            out += attention_shapes(rows, contexts, heads, kv, d, c.rotary_dim, style)
        if "linear_attention" in c.layer_types:
            hk, hv, dk, dv = cls.gdn_dims(c)
            out += cls.gdn_projection_shapes(c, rows)
            out += [kernel("gdn_decode" if m == 1 else "gdn_prefill", rows=m, hk=hk, hv=hv, dk=dk, dv=dv,
                           k=c.linear_conv_kernel_dim) for m in rows]
        for i in range(c.num_hidden_layers):
            out += cls.mlp_kernel_shapes(c, i, rows)
        return out + lm_head_shapes(c.vocab_size, h, style)

    @classmethod
    def mixer_shapes(cls, rows, n: int, hidden: int, out_proj: tuple[int, int]) -> list:
        """A mixer's packed input projections (at decode with the residual add and the input norm inside
        their GEMV, where the MLP before them does the same) and its output projection."""
        out = gemms(rows, (n, hidden), out_proj)
        if cls.norm_in_next_gemv and 1 in rows:
            out.append(kernel("rmsnorm_gemm", rows=1, n=n, k=hidden, style=cls.norm_style, add=True))
        return out

    @classmethod
    def gdn_projection_shapes(cls, c, rows) -> list:
        hk, hv, dk, dv = cls.gdn_dims(c)
        return cls.mixer_shapes(rows, 2 * hk * dk + 2 * hv * dv + 2 * hv, c.hidden_size, (c.hidden_size, hv * dv))

    @classmethod
    def mlp_kernel_shapes(cls, c, layer: int, rows) -> list:
        return gated_mlp_shapes(rows, c.hidden_size, c.intermediate_size, c.hidden_act, cls.norm_style,
                                norm_inside=cls.norm_in_next_gemv)

    # -- state ----------------------------------------------------------------------------------
    def make_state(self, dtype, device):
        c = self.cfg
        hk, hv, dk, dv = self.gdn_dims(c)
        return [GDNState(2 * hk * dk + hv * dv, c.linear_conv_kernel_dim, hv, dk, dv, dtype, device)
                if kind == "linear_attention" else self.kv_cache(c.num_key_value_heads, c.head_dim, dtype, device)
                for kind in c.layer_types]

    # -- forward --------------------------------------------------------------------------------
    def mixer_input(self, i, h):
        """Layer i's mixer input projections from its normed input h: GDN (qkv, z, b, a) or attention
        (q|gate, k, v); Qwen3-Next overrides this for its packed GDN layout."""
        p = f"model.layers.{i}."
        if self.cfg.layer_types[i] == "linear_attention":
            return self.ops.linear_split(h, self.w[p + "linear_attn.in_proj_qkvzba.weight"], self.gdn_sizes)
        return self.ops.linear_split(h, self.w[p + "self_attn.qkv_proj.weight"], self.qkv_sizes)

    def norm_next(self, i, x, m):
        """The residual add and layer i's input norm, then its mixer's projections: (x + m, projections)
        (with the norm inside their GEMV at decode, where the tuner chose it)."""
        w, p, eps = self.w, f"model.layers.{i}.", self.cfg.rms_norm_eps
        if not self.norm_in_next_gemv:
            x, h = self.ops.add_rmsnorm(x, m, w[p + "input_layernorm.weight"], eps, self.norm_style)
            return x, self.mixer_input(i, h)
        gdn = self.cfg.layer_types[i] == "linear_attention"
        packed = w[p + ("linear_attn.in_proj_qkvzba.weight" if gdn else "self_attn.qkv_proj.weight")]
        return self.ops.add_rmsnorm_linear_split(x, m, w[p + "input_layernorm.weight"], eps, self.norm_style, packed,
                                                 self.gdn_sizes if gdn else self.qkv_sizes)

    def linear_attention(self, i, proj, state):
        c, w, p = self.cfg, self.w, f"model.layers.{i}.linear_attn."
        qkv, z, b, a = proj
        params = {n: w[p + n] for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")}
        dims = (*self.gdn_dims(c), c.rms_norm_eps)
        y = per_request(state, lambda s, qkv, z, b, a: self.ops.gated_deltanet(qkv, z, b, a, params, s, dims),
                        qkv, z, b, a,
                        whole=lambda s, qkv, z, b, a: self.ops.gated_deltanet_rows(qkv, z, b, a, params, s, dims))
        return self.ops.linear_later(y, w[p + "out_proj.weight"])     # the add + norm after it may compute it

    def full_attention(self, i, proj, positions, cache, rope):
        c, w, ops, p = self.cfg, self.w, self.ops, f"model.layers.{i}.self_attn."
        qg, k, v = proj
        t, d, eps = qg.shape[0], c.head_dim, c.rms_norm_eps
        q, gate = qg.view(t, -1, 2 * d).chunk(2, dim=-1)                                 # per-head interleave
        k, v = k.view(t, -1, d), v.view(t, -1, d)
        qn, kn = w[p + "q_norm.weight"], w[p + "k_norm.weight"]
        o = per_request(cache, lambda s, q, k, v, g, cos, sin, pos: ops.qk_norm_rope_attention(
            q, k, v, qn, kn, eps, "offset", (cos, sin), s, pos, default_scale(d), gate=g),   # sigmoid(gate) * o
            q, k, v, gate, *rope, positions,
            whole=lambda s, q, k, v, g, cos, sin, pos: ops.qk_norm_rope_attention_rows(
                q, k, v, qn, kn, eps, "offset", (cos, sin), s, pos, default_scale(d), gate=g))
        return ops.linear_later(o.reshape(t, -1), w[p + "o_proj.weight"])

    def mlp(self, i, x):
        """The MLP's output, only ever the residual branch of the add + norm after it (norm_next, the
        final norm): its down projection may be handed on to that norm (ops.linear_later)."""
        w, p = self.w, f"model.layers.{i}.mlp."
        return self.ops.gated_mlp(x, w[p + "gate_up_proj.weight"], w[p + "down_proj.weight"], self.cfg.hidden_act,
                                  later=True)

    def norm_mlp(self, i, x, a):
        """The residual add, the post-attention norm and the MLP: (x + a, mlp(norm(x + a)))."""
        w, p = self.w, f"model.layers.{i}."
        if not self.norm_in_next_gemv:
            x, h = self.ops.add_rmsnorm(x, a, w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps,
                                        self.norm_style)
            return x, self.mlp(i, h)
        return self.ops.add_rmsnorm_gated_mlp(x, a, w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps,
                                              self.norm_style, w[p + "mlp.gate_up_proj.weight"],
                                              w[p + "mlp.down_proj.weight"], self.cfg.hidden_act, later=True)

    def forward(self, ids, positions, state, last_only=True):
        c, w, ops, eps = self.cfg, self.w, self.ops, self.cfg.rms_norm_eps
        x = ops.embed(ids, w["model.embed_tokens.weight"])
        rope = ops.rope_tables(positions, self.inv_freq, x.dtype)
        proj = self.mixer_input(0, ops.rmsnorm(x, w["model.layers.0.input_layernorm.weight"], eps, self.norm_style))
        for i, kind in enumerate(c.layer_types):
            if kind == "linear_attention":
                a = self.linear_attention(i, proj, state[i])
            else:
                a = self.full_attention(i, proj, positions, state[i], rope)
            # each residual add fused into the norm that follows it (bit-equal: the sum is rounded first)
            x, m = self.norm_mlp(i, x, a)
            if i + 1 < len(c.layer_types):
                x, proj = self.norm_next(i + 1, x, m)
            self.layer_done()
        x, m = last_rows(x, last_only), last_rows(ops.now(m), last_only)
        return ops.logits(ops.add_rmsnorm(x, m, w["model.norm.weight"], eps, self.norm_style)[1], self.lm_head)


# The norms mlx-lm's qwen3_5 sanitize stores as 1 + w (HF applies them as 1 + w in f32).
_MLX_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                     ".q_norm.weight", ".k_norm.weight")


def undo_mlx_sanitize(ckpt):
    """A checkpoint that mlx-lm wrote (its conv1d weights [C, K, 1], HF's are [C, 1, K]) in HF's
    form: conv1d axes moved back, and 1 taken off the norms it stored as 1 + w (exact in f32, so the
    1 + w kiln computes is mlx-lm's weight). Any other checkpoint is returned as it is."""
    conv = [n for n, s in ckpt.shapes.items() if n.endswith("conv1d.weight") and len(s) == 3 and s[-1] == 1 < s[1]]
    if not conv:
        return ckpt
    shapes = dict(ckpt.shapes)
    for n in conv:
        c, k, _ = shapes[n]
        shapes[n] = (c, 1, k)
    offset = {n for n in shapes if n.endswith(_MLX_OFFSET_NORMS)}

    def load(name: str):
        t = ckpt.load(name)
        if name in conv:
            return t.transpose(1, 2).contiguous()
        return t.float() - 1.0 if name in offset else t

    return dataclasses.replace(ckpt, shapes=shapes, loader=load, locator=None, located=None)
