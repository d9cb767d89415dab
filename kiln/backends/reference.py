"""The reference backend: plain PyTorch, rounding exactly where the HF reference rounds.

This is the executable specification and the oracle in tests; it runs on CPU and GPU. Model files
call these methods through `ops`; a fast backend overrides them with compiled kernels. Fused ops
(e.g. `rmsnorm_linear`, `gated_mlp`) are written here as their composition.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,      # Qwen3.5's attention output gate
}


class ReferenceOps:
    name = "reference"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    # -- elementwise and norms --------------------------------------------------------------
    def embed(self, ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        x = F.embedding(ids, table)
        if scale is not None:  # Gemma: the scale is cast to the weight dtype first, as HF does
            x = x * torch.tensor(scale, dtype=table.dtype)   # a CPU scalar: no copy, so a graph can hold it
        return x

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
        """style "llama": cast the normed value, then * w; "offset": (x_n * (1 + w)) in f32, then cast
        (Gemma 3, Qwen3.5); "plain": (x_n * w) in f32, then cast (Gemma 4)."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if style == "llama":
            return w * normed.to(x.dtype)
        if style == "offset":
            return (normed * (1.0 + w.float())).to(x.dtype)
        return (normed * w.float()).to(x.dtype)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b)

    def add_rmsnorm(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, style: str = "llama"):
        """The residual add and the next norm: (x + r, rmsnorm(x + r)) (one pass on GPU)."""
        s = x + r
        return s, self.rmsnorm(s, w, eps, style)

    def act_mul(self, g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
        """act(g) * u, each rounded to the activation dtype as torch does (one pass on GPU)."""
        return _ACTIVATIONS[act](g) * u

    def linear_split(self, x: torch.Tensor, ws: list) -> list:
        """Several projections of the same input (one GEMM on GPU where their weights are concatenated)."""
        return [self.linear(x, w) for w in ws]

    def rmsnorm_linear(self, x, norm_w, eps, style, w):
        """Norm fused into the next projection (fused on GPU where the tuner finds it pays)."""
        return self.linear(self.rmsnorm(x, norm_w, eps, style), w)

    def gated_mlp(self, x, gate_w, up_w, down_w, act: str) -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU / GeGLU."""
        return self.linear(self.act_mul(self.linear(x, gate_w), self.linear(x, up_w), act), down_w)

    def add_rmsnorm_linear_split(self, x, r, norm_w, eps: float, style: str, ws) -> tuple:
        """The residual add, the next layer's input norm and its projections: (x + r, [h @ w^T for w in
        ws]) with h = rmsnorm(x + r); on GPU at decode the norm can run inside their GEMV."""
        s, h = self.add_rmsnorm(x, r, norm_w, eps, style)
        return s, self.linear_split(h, ws)

    def add_rmsnorm_gated_mlp(self, x, r, norm_w, eps: float, style: str, gate_w, up_w, down_w, act: str):
        """The residual add, the post-attention norm and the MLP: (x + r, gated_mlp(rmsnorm(x + r)));
        on GPU at decode the norm can run inside the gate|up GEMV."""
        s, h = self.add_rmsnorm(x, r, norm_w, eps, style)
        return s, self.gated_mlp(h, gate_w, up_w, down_w, act)

    def moe_experts(self, x, idx, weights, gate_up, down, act: str) -> torch.Tensor:
        """Routed experts: x [T, H]; idx/weights [T, k]; gate_up [E, 2I, H] (gate rows first);
        down [E, H, I]. Each chosen expert's output, times its weight, is added into a zero buffer
        in the activation dtype, experts in ascending id, as HF's experts module does."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gate, up = self.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = self.linear(_ACTIVATIONS[act](gate) * up, down[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    # -- positions -----------------------------------------------------------------------------
    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype, scaling: float = 1.0):
        """cos/sin [T, rotary_dim] computed in f32 then cast, as HF's rotary embedding does."""
        freqs = positions[:, None].float() * inv_freq[None, :].float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; rotates the first cos.shape[-1] dims (rotate_half pairing i, i + r/2)."""
        r = cos.shape[-1]
        xr, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        out = xr * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q, k, v, cache, positions, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Causal GQA attention of this chunk's queries over the cached prefix plus the chunk.
        q [T, H, D], k/v [T, KV, D] -> [T, H, D]. Scores in the activation dtype, softmax in f32
        then rounded to it, as HF's eager attention does."""
        keys, values, kpos = cache.update(k, v, positions)
        # The same contiguous [1, H, T|S, D] operands and matmul calls as HF's eager attention, so
        # that cuBLAS picks the same kernels (and roundings) for every T, decode included.
        group = q.shape[1] // keys.shape[1]
        q4 = q.transpose(0, 1)[None].contiguous()                                   # [1, H, T, D]
        k4, v4 = (x.transpose(0, 1)[None].repeat_interleave(group, dim=1).contiguous() for x in (keys, values))
        scores = torch.matmul(q4, k4.transpose(2, 3))[0] * scale                    # [H, T, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = kpos[None, :] <= positions[:, None]     # [T, S]
        if window is not None:
            allowed &= kpos[None, :] > positions[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs[None], v4)[0].transpose(0, 1)                        # [T, H, D]

    def qk_norm_rope_attention(self, q, k, v, q_norm_w, k_norm_w, eps: float, style: str, rope, cache, positions,
                               scale: float, window: int | None = None, softcap: float | None = None, gate=None):
        """q/k RMSNorm (when the family has it), RoPE, the KV append and attention: one seam, so a
        backend can fuse the norm, the rotation and the append into one kernel. gate (Qwen3.5's
        gated attention, [T, H, D] like q): the output is sigmoid(gate) * o, as act_mul rounds it."""
        if q_norm_w is not None:
            q, k = self.rmsnorm(q, q_norm_w, eps, style), self.rmsnorm(k, k_norm_w, eps, style)
        q, k = self.apply_rope(q, *rope), self.apply_rope(k, *rope)
        o = self.attention(q, k, v, cache, positions, scale, window, softcap)
        return o if gate is None else self.act_mul(gate, o.view(gate.shape), "sigmoid")

    # -- mixture of experts ------------------------------------------------------------------------
    def shared_gate_add(self, routed, x, gate_w, shared) -> torch.Tensor:
        """Qwen's shared expert, scaled by a sigmoid gate [1, H] and added to the routed experts."""
        return routed + self.linear(x, gate_w).sigmoid() * shared

    def moe_experts_gated(self, x, idx, weights, gate_up, down, act: str, gate_w, shared) -> torch.Tensor:
        """The routed experts plus the sigmoid-gated shared expert (Qwen's sparse MoE block output)."""
        return self.shared_gate_add(self.moe_experts(x, idx, weights, gate_up, down, act), x, gate_w, shared)

    def router_topk(self, logits: torch.Tensor, k: int, renormalize: bool = True):
        """Softmax in f32, top-k, optional renormalisation in f32, weights cast back to the logits dtype."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx

    # -- gated deltanet (Qwen3.5 / Qwen3-Next linear attention) ------------------------------------
    def gated_deltanet(self, qkv, z, b, a, p: dict, state, dims) -> torch.Tensor:
        """The GDN mixer between the input projections and out_proj, one seam for a fused decode step.
        qkv [T, 2*Hk*dk + Hv*dv] (q | k | v), z [T, Hv*dv], b/a [T, Hv]; p holds conv1d.weight [C, 1, K],
        A_log, dt_bias, norm.weight; dims = (Hk, Hv, dk, dv, eps). Returns y [T, Hv*dv]."""
        hk, hv, dk, dv, eps = dims
        t = qkv.shape[0]
        qkv = self.causal_conv1d(qkv, p["conv1d.weight"], state)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        beta = torch.sigmoid(b)
        g = -p["A_log"].float().exp() * F.softplus(a.float() + p["dt_bias"])   # f32 log-decay
        rule = self.gdn_recurrent if t == 1 else self.gdn_chunked
        o = rule(q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), g, beta, state)
        y = self.gated_rmsnorm(o, z.view(t, hv, dv), p["norm.weight"], eps)
        state.length += t
        # contiguous: a strided input makes F.linear round differently from HF's contiguous one
        return y.reshape(t, hv * dv).contiguous()

    def causal_conv1d(self, x: torch.Tensor, w: torch.Tensor, state) -> torch.Tensor:
        """Depthwise causal conv over time + SiLU. x [T, C]; w [C, 1, K]; state.conv holds the last
        K inputs [K, C] and is updated. Computed in the weight dtype with HF's operand shapes:
        a decode step convolves [K state | 1 new] and keeps the last output, a prefill convolves
        [K-1 state | T new] (so cuDNN picks the same algorithm, and rounding, as HF's path)."""
        k, t = w.shape[-1], x.shape[0]
        past = state.conv if (t == 1 and state.length > 0) else state.conv[1:]
        full = torch.cat([past.to(x.dtype), x], dim=0)                          # [K+1 | K-1+T, C]
        state.conv = full[-k:].clone()
        y = F.conv1d(full.T[None].to(w.dtype), w, groups=w.shape[0])[0].T[-t:]  # [T, C]
        return F.silu(y).to(x.dtype)

    def gated_rmsnorm(self, x, z, w, eps: float) -> torch.Tensor:
        """(w * rmsnorm_f32(x).cast) * silu(z.f32), then cast: plain w, not 1 + w."""
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return ((w * normed) * F.silu(z.float())).to(x.dtype)

    @staticmethod
    def _gdn_inputs(q, k, v, g, beta):
        """Heads first in f32, q/k l2-normalised; key head j // (Hv/Hk) serves value head j."""
        rep = v.shape[1] // q.shape[1]
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))   # [H, T, ...]
        return _l2norm(q), _l2norm(k), v, g, beta

    def gdn_recurrent(self, q, k, v, g, beta, state) -> torch.Tensor:
        """Token by token: S = S*exp(g); u = (v - S^T k) * beta; S += k (x) u; o = S^T q.
        q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv]; state.ssm [Hv, dk, dv] f32, updated."""
        dtype = v.dtype
        q, k, v, g, beta = self._gdn_inputs(q, k, v, g, beta)
        q = q / (q.shape[-1] ** 0.5)
        s = state.ssm
        out = torch.empty_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t].exp()[:, None, None]
            kv = (s * k[:, t, :, None]).sum(dim=-2)                                     # [H, dv]
            u = (v[:, t] - kv) * beta[:, t, None]
            s = s + k[:, t, :, None] * u[:, None, :]
            out[:, t] = (s * q[:, t, :, None]).sum(dim=-2)
        state.ssm = s
        return out.transpose(0, 1).to(dtype)

    def gdn_chunked(self, q, k, v, g, beta, state, chunk: int = 64) -> torch.Tensor:
        """The same rule in chunks: within a chunk the delta updates are condensed by a unit lower-
        triangular solve (WY/UT form); chunks are scanned in order over the f32 state."""
        dtype, n = v.dtype, v.shape[0]
        q, k, v, g, beta = self._gdn_inputs(q, k, v, g, beta)
        q = q * q.shape[-1] ** -0.5
        pad = (chunk - n % chunk) % chunk
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
        h = q.shape[0]
        v_beta, k_beta = v * beta[..., None], k * beta[..., None]
        q, k, k_beta, v_beta = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
        cum = g.reshape(h, -1, chunk).cumsum(dim=-1)                                   # [H, N, C]
        upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * decay
        intra = (q @ k.transpose(-1, -2)) * decay
        u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
        q = q * cum.exp()[..., None]
        k = k * (cum[..., -1:] - cum).exp()[..., None]
        step = cum[..., -1].exp()[..., None, None]
        s, out = state.ssm, torch.empty_like(u)
        for i in range(q.shape[1]):
            v_new = u[:, i] - w[:, i] @ s
            out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
            s = s * step[:, i] + k[:, i].transpose(-1, -2) @ v_new
        state.ssm = s
        return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1).to(dtype)

    # -- output --------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor, w: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        out = self.linear(x, w)
        if softcap is not None:
            out = torch.tanh(out / softcap) * softcap
        return out

    # -- gemma4 --
    def rmsnorm_noscale(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm with no weight (Gemma 4's v_norm and router norm): normed in f32, then cast."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def scaled_router(self, x, scale, proj_w, expert_scale, k: int, eps: float):
        """Gemma 4 router: proj(rmsnorm(x) * scale * H^-0.5), each product rounded to x's dtype as
        in HF; softmax, top-k and renormalisation in f32; times per_expert_scale[idx]. The weights
        stay f32 (the expert outputs are multiplied by them in f32, then rounded)."""
        h = self.rmsnorm_noscale(x, eps) * scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.linear(h, proj_w), dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top * expert_scale[idx], idx

    def gated_input(self, x, gate_w, signal, proj_w, act: str) -> torch.Tensor:
        """proj(act(gate(x)) * signal): Gemma 4's per-layer-input block."""
        return self.linear(_ACTIVATIONS[act](self.linear(x, gate_w)) * signal, proj_w)


def inv_freq(dim: int, theta: float, factor: float = 1.0) -> torch.Tensor:
    """Default RoPE inverse frequencies (linear scaling divides them by `factor`)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)) / factor


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
