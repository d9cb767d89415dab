"""Attention, the reference: causal GQA over the cache with HF eager attention's operands and roundings."""

from __future__ import annotations

import torch


class AttentionReference:
    """Needs the norms, RoPE and the activations beside it (rmsnorm, apply_rope, act_mul)."""

    def window_cache(self, n_kv: int, head_dim: int, window: int, dtype, device):
        """A sliding-window layer's cache where this backend's kernels keep a ring of their own
        (cuda: kiln.cache.WindowKVCache); None here: the model's choice (a plain buffer, or its
        RingKVCache)."""
        return None

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
                               scale: float, window: int | None = None, softcap: float | None = None, gate=None,
                               v_norm: bool = False):
        """q/k RMSNorm (when the family has it), RoPE, the KV append and attention: one seam, so a
        backend can fuse the norm, the rotation and the append into one kernel. gate (Qwen3.5's
        gated attention, [T, H, D] like q): the output is sigmoid(gate) * o, as act_mul rounds it.
        v_norm (Gemma 4): v RMS-normed without a weight (v may be k itself, the un-normed keys)."""
        if v_norm:
            v = self.rmsnorm_noscale(v, eps)
        if q_norm_w is not None:
            q, k = self.rmsnorm(q, q_norm_w, eps, style), self.rmsnorm(k, k_norm_w, eps, style)
        q, k = self.apply_rope(q, *rope), self.apply_rope(k, *rope)
        o = self.attention(q, k, v, cache, positions, scale, window, softcap)
        return o if gate is None else self.act_mul(gate, o.view(gate.shape), "sigmoid")

    def qk_norm_rope_attention_rows(self, q, k, v, q_norm_w, k_norm_w, eps: float, style: str, rope, states, positions,
                                    scale: float, window: int | None = None, softcap: float | None = None, gate=None,
                                    v_norm: bool = False):
        """qk_norm_rope_attention for a batched decode step (row j: one token of request j over
        states[j], a kiln.cache.StateBatch) at once, where a backend has a kernel for it; None here
        (each request then runs alone on its row)."""
        return None
