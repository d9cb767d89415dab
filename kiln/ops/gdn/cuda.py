"""Gated DeltaNet on the cuda backend: the chunked prefill kernels and the one-kernel decode step,
state updated in place (a CUDA graph holds the buffers); the reference, copied back into the same
buffers, where the kernels do not apply."""

from __future__ import annotations

import torch

from ...cache import GDNState, SlotGDN
from ..counters import keep_counters
from ..dispatch import TunedOps
from . import kernels
from .reference import GdnReference
from .unpack import unpack

keep_counters(kernels)  # a captured graph's arrival counters never freed (kiln/ops/counters.py)

# b and a of a padded prefill's spare rows: sigmoid(b) and softplus(a + dt_bias) are then exactly 0
# in f32, so such a row's beta and log-decay are 0 and it leaves the recurrent state as it was.
PAD_GATE = -1.0e4


def conv_tail(conv, old, x, n) -> None:
    """conv = the last K conv inputs of the first n rows of x (n an int tensor [1] on the device):
    rows n-1+j, j < K, of [old[1:] | x], as the conv kernel keeps them after exactly n rows."""
    k = conv.shape[0]
    i = n - 1 + torch.arange(k, device=conv.device)
    from_old = old.index_select(0, (i + 1).clamp(max=k - 1))
    from_x = x.index_select(0, (i - (k - 1)).clamp(min=0))
    conv.copy_(torch.where((i < k - 1)[:, None], from_old, from_x.to(conv.dtype)))


def contiguous_parts(qkv, z, b, a) -> tuple:
    """The mixer's inputs, copied out of the packed projection in one launch where they are its column
    views (more than one row; a row alone is contiguous already), else as given."""
    return (unpack(qkv, z, b, a) if qkv.shape[0] > 1 else None) or (qkv, z, b, a)


class GdnCuda(TunedOps, GdnReference):
    def gated_deltanet(self, qkv, z, b, a, p, state, dims):
        if isinstance(state, GDNState) and state.valid is not None:
            return self._padded(qkv, z, b, a, p, state, dims)
        return self._mixer(qkv, z, b, a, p, state, dims)

    def _mixer(self, qkv, z, b, a, p, state, dims):
        conv_w = p["conv1d.weight"]
        if (not self.on("gdn", qkv) or not isinstance(state, GDNState)
                or not kernels.PREFILL.supports(qkv, conv_w, state.ssm, dims)):
            return self._gdn_in_place(qkv, z, b, a, p, state, dims)
        qkv, z, b, a = contiguous_parts(qkv, z, b, a)
        args = (qkv, z, b, a, conv_w, p["A_log"], p["dt_bias"], p["norm.weight"], state.conv, state.ssm, dims)
        t, (hk, hv, dk, dv, _) = qkv.shape[0], dims
        shape = kernels.GdnShape(t, hk, hv, dk, dv, conv_w.shape[-1])
        if t == 1 and state.length > 0:
            y = kernels.gdn_decode(*args, v=self.choose(kernels.DECODE, shape))
        else:
            y = kernels.gdn_prefill(*args, v=self.choose(kernels.PREFILL, shape))
        state.length += t
        return y

    def _padded(self, qkv, z, b, a, p, state, dims):
        """A prefill whose rows from state.valid on are padding (their outputs are junk, never read):
        those rows' gates pushed to PAD_GATE, then the conv state re-taken from the prompt's rows."""
        n, t = state.valid, qkv.shape[0]
        parts = unpack(qkv, z, b, a, n, PAD_GATE) if self.on("gdn", qkv) else None    # copies and gates at once
        if parts is None:
            pad = (torch.arange(t, device=qkv.device) >= n)[:, None]
            b, a = b.masked_fill(pad, PAD_GATE), a.masked_fill(pad, PAD_GATE)
        else:
            qkv, z, b, a = parts
        old = state.conv.clone()
        y = self._mixer(qkv, z, b, a, p, state, dims)
        conv_tail(state.conv, old, qkv, n)
        return y

    def gated_deltanet_rows(self, qkv, z, b, a, p, states, dims):
        """A batched decode step's GDN in one launch, when every request's state is a slot of one pool
        (StateBatch.slots) and the tuner chose a fused decode kernel; else None."""
        conv_w, first = p["conv1d.weight"], states[0]
        if (states.slots is None or not isinstance(first, SlotGDN) or not self.on("gdn", qkv)
                or not kernels.PREFILL.supports(qkv, conv_w, first.ssm, dims)):
            return None
        hk, hv, dk, dv, _ = dims
        v = self.choose(kernels.DECODE, kernels.GdnShape(1, hk, hv, dk, dv, conv_w.shape[-1]))
        if v.p["form"] == "unfused":
            return None
        qkv, z, b, a = contiguous_parts(qkv, z, b, a)
        y = kernels.gdn_decode_rows(qkv, z, b, a, conv_w, p["A_log"], p["dt_bias"], p["norm.weight"],
                                    first.pool_conv, first.pool_ssm, states.slots, dims, v)
        for s in states:
            s.length += 1
        return y

    def _gdn_in_place(self, qkv, z, b, a, p, state, dims):
        """The reference op, its new state copied back into the same buffers (a graph holds them)."""
        conv, ssm = state.conv, state.ssm
        y = super().gated_deltanet(qkv, z, b, a, p, state, dims)
        conv.copy_(state.conv)
        ssm.copy_(state.ssm)
        state.conv, state.ssm = conv, ssm
        return y
