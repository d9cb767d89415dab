"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention), the reference: the causal conv, the delta
rule token by token (decode) or in chunks (prefill), and the gated norm, rounding as HF does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GdnReference:
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

    def gated_deltanet_rows(self, qkv, z, b, a, p: dict, states, dims) -> torch.Tensor | None:
        """gated_deltanet for a batched decode step (row j: one token of request j over states[j], a
        kiln.cache.StateBatch) at once, where a backend has a kernel for it; None here (each request
        then runs alone on its row)."""
        return None

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
        return l2norm(q), l2norm(k), v, g, beta

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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
