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
}


class ReferenceOps:
    name = "reference"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    # -- elementwise and norms --------------------------------------------------------------
    def embed(self, ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        x = F.embedding(ids, table)
        if scale is not None:  # Gemma: the scale is cast to the weight dtype first, as HF does
            x = x * torch.tensor(scale, dtype=table.dtype, device=x.device)
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

    def rmsnorm_linear(self, x, norm_w, eps, style, w):
        """Norm fused into the next projection (fused on GPU where the tuner finds it pays)."""
        return self.linear(self.rmsnorm(x, norm_w, eps, style), w)

    def gated_mlp(self, x, gate_w, up_w, down_w, act: str) -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU / GeGLU."""
        return self.linear(_ACTIVATIONS[act](self.linear(x, gate_w)) * self.linear(x, up_w), down_w)

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
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)      # [S, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = kpos[None, :] <= positions[:, None]     # [T, S]
        if window is not None:
            allowed &= kpos[None, :] > positions[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hts,shd->thd", probs, values)

    # -- output --------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor, w: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        out = self.linear(x, w)
        if softcap is not None:
            out = torch.tanh(out / softcap) * softcap
        return out


def inv_freq(dim: int, theta: float, factor: float = 1.0) -> torch.Tensor:
    """Default RoPE inverse frequencies (linear scaling divides them by `factor`)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)) / factor


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
