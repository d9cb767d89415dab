"""RoPE, the reference: cos/sin tables in f32 then cast, rotate_half pairing, as HF computes them."""

from __future__ import annotations

import torch


class RopeReference:
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
