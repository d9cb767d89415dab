"""Gemma 4 text (dense and MoE): sandwich norms with plain `w`, q/k norm and unscaled v norm,
attention scale 1.0, sliding layers and full layers with their own head dim and KV heads
(`per_layer_config`), keys doubling as values on full layers (`attention_k_eq_v`), proportional
partial RoPE on full layers, a dense MLP plus routed experts, per-layer input embeddings (PLE),
KV sharing for the last layers, `layer_scalar`, tanh logit softcap. Sliding layers keep a ring."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..cache import RingKVCache, StateBatch
from ..errors import KilnError
from .base import (
    Model,
    config_from_dict,
    fuse_experts,
    gated_mlp_shapes,
    gemms,
    kernel,
    last_rows,
    lm_head_shapes,
    norms,
    per_request,
    stacks_to_fused,
)
from .rope import inv_freq

_OVERRIDABLE = {"head_dim", "num_key_value_heads"}  # per_layer_config keys the HF model reads
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


@dataclass
class Gemma4Config:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 4          # defaults are HF's, so a key a config omits means the same
    head_dim: int = 256
    global_head_dim: int = 512            # read only when per_layer_config is absent (configs
    num_global_key_value_heads: int | None = None  # saved before transformers moved them there)
    per_layer_config: dict | None = None  # {"05": {"head_dim": 512, "num_key_value_heads": 2}, ...}
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    attention_k_eq_v: bool = False
    use_bidirectional_attention: str | None = None
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262_144
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    head_dims: list = field(default_factory=list, init=False)   # resolved per layer
    kv_heads: list = field(default_factory=list, init=False)
    kv_source: list = field(default_factory=list, init=False)   # producer layer of a KV-shared layer

    def __post_init__(self):
        if self.use_bidirectional_attention == "all":
            raise KilnError("gemma4: use_bidirectional_attention='all' (a non-causal model) is not supported")
        if self.attention_bias:
            raise KilnError("gemma4: attention_bias is not supported (no Gemma 4 checkpoint uses it)")
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
        self.layer_types = list(self.layer_types)
        self.layer_types[-1] = "full_attention"  # HF forces this too
        self.rope_parameters = self.rope_parameters or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
        self._resolve_heads()
        self._resolve_kv_sharing()
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            raise KilnError("gemma4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")

    def _resolve_heads(self):
        overrides = self.per_layer_config
        if overrides is None:  # HF's defaults: full layers get global_head_dim (and, with k_eq_v, KV heads)
            full = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == "full_attention"}
        overrides = {int(i): o for i, o in overrides.items()}
        for i, o in overrides.items():
            if set(o) - _OVERRIDABLE:
                raise KilnError(f"gemma4: per_layer_config[{i}] overrides {sorted(set(o) - _OVERRIDABLE)}, "
                                "which kiln does not support")
        layer = [overrides.get(i, {}) for i in range(self.num_hidden_layers)]
        self.head_dims = [o.get("head_dim", self.head_dim) for o in layer]
        self.kv_heads = [o.get("num_key_value_heads", self.num_key_value_heads) for o in layer]
        for kind in set(self.layer_types):
            if len({d for d, t in zip(self.head_dims, self.layer_types) if t == kind}) > 1:
                raise KilnError(f"gemma4: {kind} layers differ in head_dim (RoPE is per layer type)")

    def _resolve_kv_sharing(self):
        """Layers from L - num_kv_shared_layers on reuse the K/V of the last earlier layer of their type."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if first <= 0:
            raise KilnError("gemma4: every layer is KV-shared (an assistant model); not supported")
        self.kv_source = [None] * first
        for t in self.layer_types[first:]:
            if t not in self.layer_types[:first]:
                raise KilnError(f"gemma4: a KV-shared {t} layer has no earlier {t} layer to read from")
            self.kv_source.append(first - 1 - self.layer_types[:first][::-1].index(t))

    @property
    def first_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def full(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """HF's inverse frequencies. "proportional": the first partial_rotary_factor of the head's
    frequency pairs with exponents over the whole head dim, the rest 0 (cos 1, sin 0), so the
    tables span the head dim and rotate_half pairs (i, i + head_dim/2)."""
    kind, theta = params.get("rope_type", "default"), params["rope_theta"]
    if kind == "default":
        return inv_freq(head_dim, theta)
    if kind != "proportional":
        raise KilnError(f"gemma4: rope_type {kind!r} is not supported (default, proportional)")
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    # NOTE: the same length of arange as HF: pow's vector and scalar paths may differ in the last bit.
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / params.get("factor", 1.0)


class KVProducer:
    """A layer's cache whose K/V the KV-shared layers after it also attend over: it keeps what its
    last update returned (this forward's keys, values and key positions)."""
    length = property(lambda self: self.cache.length)

    def __init__(self, cache):
        self.cache, self.last = cache, None

    def truncate(self, n: int) -> bool:
        return self.cache.truncate(n)

    def update(self, k, v, positions):
        self.last = self.cache.update(k, v, positions)
        return self.last


class KVShared:
    """A KV-shared layer's state: nothing of its own; it reads its producer's last update."""
    length = property(lambda self: self.producer.length)

    def __init__(self, producer: KVProducer):
        self.producer = producer

    def truncate(self, n: int) -> bool:
        return True

    def update(self, k, v, positions):
        return self.producer.last


class Gemma4(Model):
    several_prompts = True   # prompts prefilled together: per_request slices each one's rows
    config_class = Gemma4Config
    norm_style = "plain"
    packed = {"mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
              "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"),
              "self_attn.qk_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight")}  # k_eq_v

    def __init__(self, cfg, weights, ops):
        super().__init__(cfg, weights, ops)
        self.inv_freq = {t: rope_inv_freq(cfg.rope_parameters[t], cfg.head_dims[cfg.layer_types.index(t)])
                         .to(ops.device) for t in set(cfg.layer_types)}
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    @classmethod
    def weight_shapes(cls, c):
        h, n, v = c.hidden_size, c.num_attention_heads, c.vocab_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
        pl, ple = c.num_hidden_layers, c.hidden_size_per_layer_input
        if ple:
            shapes.update({"model.embed_tokens_per_layer.weight": (c.vocab_size_per_layer_input, pl * ple),
                           "model.per_layer_model_projection.weight": (pl * ple, h),
                           "model.per_layer_projection_norm.weight": (ple,)})
        for i in range(pl):
            p, d, f = f"model.layers.{i}.", c.head_dims[i], c.intermediate_size
            f *= 2 if c.use_double_wide_mlp and c.kv_source[i] is not None else 1
            shapes.update({p + "layer_scalar": (1,), p + "self_attn.q_norm.weight": (d,),
                           p + "self_attn.q_proj.weight": (n * d, h), p + "self_attn.o_proj.weight": (h, n * d),
                           p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
            shapes.update({f"{p}{k}.weight": (h,) for k in _NORMS})
            if c.kv_source[i] is None:
                shapes.update(cls._kv_shapes(c, i))
            if ple:
                shapes.update({p + "per_layer_input_gate.weight": (ple, h), p + "per_layer_projection.weight": (h, ple),
                               p + "post_per_layer_input_norm.weight": (h,)})
            if c.enable_moe_block:
                e, m = c.num_experts, c.moe_intermediate_size
                shapes.update({p + "router.proj.weight": (e, h), p + "router.scale": (h,),
                               p + "router.per_expert_scale": (e,), p + "experts.gate_up_proj": (e, 2 * m, h),
                               p + "experts.down_proj": (e, h, m)})
                shapes.update({f"{p}{k}.weight": (h,) for k in _MOE_NORMS})
        return shapes

    @classmethod
    def _kv_shapes(cls, c, i):
        p, d, kv, h = f"model.layers.{i}.self_attn.", c.head_dims[i], c.kv_heads[i], c.hidden_size
        shapes = {p + "k_proj.weight": (kv * d, h), p + "k_norm.weight": (d,)}
        if not (c.attention_k_eq_v and c.full(i)):
            shapes[p + "v_proj.weight"] = (kv * d, h)
        return shapes

    @classmethod
    def sanitize(cls, ckpt):
        """Experts stored one by one (HF) or as mlx-lm's `experts.switch_glu` stacks are fused; KV-shared
        layers may carry K/V weights they never use (HF ignores them on load, mlx-lm drops them):
        those are dropped."""
        c = config_from_dict(cls.config_class, ckpt.config)
        ckpt = stacks_to_fused(fuse_experts(ckpt), "experts.switch_glu.", "experts.")
        unused = {n for i, src in enumerate(c.kv_source) if src is not None for n in cls._kv_shapes(c, i)}
        if not unused & set(ckpt.shapes):
            return ckpt
        return dataclasses.replace(ckpt, shapes={n: s for n, s in ckpt.shapes.items() if n not in unused})

    @classmethod
    def kernel_shapes(cls, c, rows, contexts):
        """Projections, norms and the routed experts of each layer; attention is left at each kernel's
        default (sliding and full layers differ in head dim, KV heads and window)."""
        h, heads, style, ple = c.hidden_size, c.num_attention_heads, cls.norm_style, c.hidden_size_per_layer_input
        out, producers = norms(rows, h, style), set(c.kv_source) - {None}
        for i in range(c.num_hidden_layers):
            d, kv = c.head_dims[i], c.kv_heads[i]
            f = c.intermediate_size * (2 if c.use_double_wide_mlp and c.kv_source[i] is not None else 1)
            if c.kv_source[i] is None:   # q|k|v (q|k where keys are values) packed; norms, RoPE and append fused
                kv_rows = kv * d * (1 if c.attention_k_eq_v and c.full(i) else 2)
                out += gemms(rows, (heads * d + kv_rows, h), (h, heads * d))
                out += [kernel("qk_rope", rows=m, h=heads, kv=kv, d=d, r=d, style=style, v_norm=True) for m in rows]
                if i in producers or d & (d - 1):   # a wrapped cache (KVProducer) or a head dim the fused
                    # kernel does not take (not a power of two): q and k normed and rotated apart
                    out += norms(rows, d, style, per_row=heads) + norms(rows, d, style, per_row=kv)
            else:                        # a KV-shared layer: q alone, normed and rotated apart
                out += gemms(rows, (heads * d, h), (h, heads * d)) + norms(rows, d, style, per_row=heads)
            out += gated_mlp_shapes(rows, h, f, c.hidden_activation, style, norm_inside=False)
            if c.enable_moe_block:
                e, m_ffn = c.num_experts, c.moe_intermediate_size
                out += gemms(rows, (e, h)) + [kernel("moe", rows=m, e=e, k=c.top_k_experts, h=h, i=m_ffn,
                                                     act=c.hidden_activation) for m in rows]
            if ple:
                out += gemms(rows, (ple, h), (h, ple))
        if ple:
            n = c.num_hidden_layers
            out += gemms(rows, (n * ple, h)) + norms(rows, ple, style, per_row=n)
        return out + cls.residual_shapes(c, rows) + lm_head_shapes(c.vocab_size, h, style)

    @classmethod
    def residual_shapes(cls, c, rows) -> list:
        """The forms of ops.residual_norms that `layer` calls: after attention (the MLP's norm, and with
        experts theirs and the router's input), after the MLP (two branches with experts; the layer
        scalar and the next norm unless the PLE step comes between), and the PLE step."""
        moe, ple = c.enable_moe_block, bool(c.hidden_size_per_layer_input)
        forms = [dict(two=False, scalar=False, outs=1 + moe, router=moe),
                 dict(two=moe, scalar=not ple, outs=0 if ple else 1, router=False)]
        if ple:
            forms.append(dict(two=False, scalar=True, outs=1, router=False))
        h, style = c.hidden_size, cls.norm_style
        return [kernel("residual_norms", rows=m, d=h, style=style, **f) for f in forms for m in rows]

    def make_state(self, dtype, device):
        """Sliding layers keep a ring of the window, or, on a backend that masks the window itself over a
        fixed buffer (`ops.static_windows`: cuda, for CUDA graphs; cpu), a plain cache."""
        c, state = self.cfg, []
        ring = not getattr(self.ops, "static_windows", False)
        producers = set(c.kv_source) - {None}
        for i, kind in enumerate(c.layer_types):
            if c.kv_source[i] is not None:
                state.append(KVShared(state[c.kv_source[i]]))
                continue
            kv, d = c.kv_heads[i], c.head_dims[i]
            cache = (self.kv_cache(kv, d, dtype, device, None if c.full(i) else c.sliding_window)
                     if c.full(i) or not ring else RingKVCache(kv, d, c.sliding_window, dtype, device))
            state.append(KVProducer(cache) if i in producers else cache)
        return state

    def attention(self, i, x, positions, cache, rope):
        c, w, ops, eps, p = self.cfg, self.w, self.ops, self.cfg.rms_norm_eps, f"model.layers.{i}.self_attn."
        d, kv, style, heads = c.head_dims[i], c.kv_heads[i], self.norm_style, c.num_attention_heads
        window = None if c.full(i) else c.sliding_window
        qn, kn = w[p + "q_norm.weight"], w.get(p + "k_norm.weight")
        if c.kv_source[i] is not None:   # a KV-shared layer reads its producer's K/V through `cache`
            q = ops.linear(x, w[p + "q_proj.weight"]).view(-1, heads, d)
            q = ops.apply_rope(ops.rmsnorm(q, qn, eps, style), *rope)
            o = per_request(cache, lambda s, q, pos: ops.attention(q, None, None, s, pos, 1.0, window), q, positions)
            return ops.linear(o.reshape(x.shape[0], -1), w[p + "o_proj.weight"])
        if c.attention_k_eq_v and c.full(i):   # values are the un-normed, un-rotated keys
            q, k = ops.linear_split(x, w[p + "qk_proj.weight"], [heads * d, kv * d])
            v = k
        else:
            q, k, v = ops.linear_split(x, w[p + "qkv_proj.weight"], [heads * d, kv * d, kv * d])
        q, k, v = q.view(-1, heads, d), k.view(-1, kv, d), v.view(-1, kv, d)

        def attend(s, q, k, v, cos, sin, pos, rows=False):
            fn = ops.qk_norm_rope_attention_rows if rows else ops.qk_norm_rope_attention
            return fn(q, k, v, qn, kn, eps, style, (cos, sin), s, pos, 1.0, window, v_norm=True)

        o = per_request(cache, attend, q, k, v, *rope, positions,
                        whole=lambda *a: attend(*a, rows=True))
        return ops.linear(o.reshape(x.shape[0], -1), w[p + "o_proj.weight"])

    def layer(self, i, x, y, positions, cache, rope, ple, next_w):
        """Layer i on the residual x and its input norm y; returns the residual after it and its norm by
        next_w (the next layer's input norm, or the final norm). Every residual add is fused with the
        sandwich norms around it (ops.residual_norms)."""
        c, w, ops, eps, style = self.cfg, self.w, self.ops, self.cfg.rms_norm_eps, self.norm_style
        p, moe = f"model.layers.{i}.", c.enable_moe_block
        h = self.attention(i, y, positions, cache, rope)
        outs = (w[p + "pre_feedforward_layernorm.weight"],) + ((w[p + "pre_feedforward_layernorm_2.weight"],)
                                                               if moe else ())
        x, ys = ops.residual_norms(x, h, eps, style, w[p + "post_attention_layernorm.weight"], outs=outs,
                                   router=w[p + "router.scale"] if moe else None)
        def dense_mlp():
            return ops.gated_mlp(ys[0], w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"],
                                 c.hidden_activation)

        both = {}
        if moe:   # the routed experts on the post-attention residual: its norm ys[1], the router's input ys[2]
            m = ops.fork(dense_mlp, ys[0])       # at decode the dense MLP runs beside the router and the experts
            weights, idx = ops.router_scaled_topk(ys[2], w[p + "router.proj.weight"], w[p + "router.per_expert_scale"],
                                                  c.top_k_experts)
            # streamed experts: their misses' read starts here and overlaps the dense MLP
            ops.moe_prefetch(idx, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"])
            e = ops.moe_experts(ys[1], idx, weights, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"],
                                c.hidden_activation)
            m = ops.join(m)
            both = dict(a_w=w[p + "post_feedforward_layernorm_1.weight"], b=e,
                        b_w=w[p + "post_feedforward_layernorm_2.weight"])
        else:
            m = dense_mlp()
        last = dict(scalar=w[p + "layer_scalar"], outs=(next_w,))
        if ple is None:
            x, ys = ops.residual_norms(x, m, eps, style, w[p + "post_feedforward_layernorm.weight"], **both, **last)
            return x, ys[0]
        x, _ = ops.residual_norms(x, m, eps, style, w[p + "post_feedforward_layernorm.weight"], **both)
        h = ops.gated_input(x, w[p + "per_layer_input_gate.weight"], ple, w[p + "per_layer_projection.weight"],
                            c.hidden_activation)
        x, ys = ops.residual_norms(x, h, eps, style, w[p + "post_per_layer_input_norm.weight"], **last)
        return x, ys[0]

    def per_layer_inputs(self, ids, x):
        """PLE: (rmsnorm(proj(x) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2), [T, L, P], each
        product rounded to the activation dtype as in HF."""
        c, w, ops, style = self.cfg, self.w, self.ops, self.norm_style
        shape = (-1, c.num_hidden_layers, c.hidden_size_per_layer_input)
        token = ops.embed(ids, w["model.embed_tokens_per_layer.weight"], scale=c.hidden_size_per_layer_input ** 0.5)
        ctx = ops.linear(x, w["model.per_layer_model_projection.weight"]) * c.hidden_size ** -0.5
        ctx = ops.rmsnorm(ctx.view(shape), w["model.per_layer_projection_norm.weight"], c.rms_norm_eps, style)
        return (ctx + token.view(shape)) * 2.0 ** -0.5

    def forward(self, ids, positions, state, last_only=True):
        c, w, ops, style, eps = self.cfg, self.w, self.ops, self.norm_style, self.cfg.rms_norm_eps
        x = ops.embed(ids, w["model.embed_tokens.weight"], scale=c.hidden_size ** 0.5)     # [T, H]
        ple = self.per_layer_inputs(ids, x) if c.hidden_size_per_layer_input else None
        ropes = {t: ops.rope_tables(positions, f, x.dtype) for t, f in self.inv_freq.items()}
        y = ops.rmsnorm(x, w["model.layers.0.input_layernorm.weight"], eps, style)
        cut = False
        for i in range(c.num_hidden_layers):
            if i == c.first_shared and last_only is not False:   # KV-shared layers write no state: only
                x, y = last_rows(x, last_only), last_rows(y, last_only)    # the rows asked for
                positions = last_rows(positions, last_only)
                ple = None if ple is None else last_rows(ple, last_only)
                ropes = {t: (last_rows(cos, last_only), last_rows(sin, last_only)) for t, (cos, sin) in ropes.items()}
                for layer in state[i:]:         # several prompts: one row each from here
                    if isinstance(layer, StateBatch) and layer.rows is not None:
                        layer.rows = [1] * len(layer.rows)
                cut = True
            last = i + 1 == c.num_hidden_layers
            next_w = w["model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"]
            x, y = self.layer(i, x, y, positions, state[i], ropes[c.layer_types[i]],
                              None if ple is None else ple[:, i], next_w)
            self.layer_done()
        return ops.logits(y if cut else last_rows(y, last_only), self.lm_head, c.final_logit_softcapping)
