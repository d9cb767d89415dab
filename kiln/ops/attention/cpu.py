"""Attention on the CPU backend: the reference's arithmetic without its GQA copies.

The reference repeats each KV head's keys and values for its query heads (HF eager attention's
operands, so cuBLAS rounds as HF does); on a CPU that copy of the whole cache every step costs more
than the products (~8 ms a token at 512 positions on SmolLM2-135M, 2 cores). Here a KV head's query
heads are stacked as rows of one batched product against its keys, read in place; without a softcap
torch's fused scaled_dot_product_attention (GQA in place too) runs it.
"""

from __future__ import annotations

import torch


class AttentionCpu:
    def attention(self, q, k, v, cache, positions, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """As AttentionReference.attention: q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
        keys, values, kpos = cache.update(k, v, positions)
        if window is not None and int(positions[0]) - window + 1 > int(kpos[0]):
            lo = int(positions[0]) - window + 1 - int(kpos[0])      # keys no query of the chunk sees
            keys, values, kpos = keys[lo:], values[lo:], kpos[lo:]
        if q.shape[0] == 1 and softcap is None:
            return _decode(q, keys, values, kpos, positions, scale, window)
        allowed = kpos[None, :] <= positions[:, None]                                 # [T, S]
        if window is not None:
            allowed &= kpos[None, :] > positions[:, None] - window
        if softcap is None:     # torch's fused CPU kernel (softmax in f32 for f32 and 16-bit inputs alike)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=allowed, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        t, h, d = q.shape
        kv = keys.shape[1]
        g = h // kv
        qg = q.reshape(t, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * t, d)     # rows (head in group, token)
        scores = torch.bmm(qg, keys.permute(1, 2, 0)) * scale                         # [KV, G*T, S]
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed.repeat(g, 1)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, values.transpose(0, 1))                                # [KV, G*T, D]
        return out.reshape(kv, g, t, d).permute(2, 0, 1, 3).reshape(t, h, d)


def _decode(q, keys, values, kpos, positions, scale: float, window: int | None) -> torch.Tensor:
    """One query row: a KV head's query heads as rows of one product against its keys in place. Every
    key left is at or before the query and inside its window, so no mask (the fused kernel's masked
    path costs more than this whole product on our 2-core CPU)."""
    h, d = q.shape[1:]
    kv = keys.shape[1]
    scores = torch.bmm(q.reshape(kv, h // kv, d), keys.permute(1, 2, 0)) * scale           # [KV, G, S]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, values.transpose(0, 1)).reshape(1, h, d)
