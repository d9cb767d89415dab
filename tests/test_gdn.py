"""Gated DeltaNet reference ops: the recurrent step and the chunked (WY/UT) form agree with each
other and with the textbook recurrence, on ragged lengths and a non-zero starting state."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.reference import ReferenceOps
from kiln.cache import GDNState

OPS = ReferenceOps("cpu")


def _inputs(t, hk=2, hv=6, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(t, hk, dk), r(t, hk, dk), r(t, hv, dv), -torch.rand(t, hv, generator=g) * 2,
            torch.rand(t, hv, generator=g))


def _state(hv=6, dk=16, dv=24, seed=1):
    s = GDNState(8, 4, hv, dk, dv, torch.float32, "cpu")
    s.ssm = torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.1
    return s


def _textbook(q, k, v, g, beta, s0):
    """S_t = exp(g) S_{t-1} + k beta (v - exp(g) S_{t-1}^T k)^T ; o_t = S_t^T q / sqrt(dk), l2-normalised q, k."""
    rep = v.shape[1] // q.shape[1]
    q, k = (torch.nn.functional.normalize(x.repeat_interleave(rep, 1).double(), dim=-1, eps=0) for x in (q, k))
    s, out = s0.double().clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], (v[t].double() - pred) * beta[t].double()[:, None])
        out.append(torch.einsum("hkv,hk->hv", s, q[t]) / q.shape[-1] ** 0.5)
    return torch.stack(out), s


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_chunked_and_recurrent_match_the_textbook_rule(t):
    q, k, v, g, beta = _inputs(t, seed=t)
    want, want_s = _textbook(q, k, v, g, beta, _state().ssm)
    for rule in (OPS.gdn_recurrent, OPS.gdn_chunked):
        st = _state()
        got = rule(q, k, v, g, beta, st)
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), rule.__name__
        assert torch.allclose(st.ssm.double(), want_s, atol=1e-4, rtol=1e-4), rule.__name__


def test_chunked_prefill_then_steps_equals_one_pass():
    q, k, v, g, beta = _inputs(100, seed=7)
    whole = _state()
    ref = OPS.gdn_chunked(q, k, v, g, beta, whole)
    parts, st = [], _state()
    parts.append(OPS.gdn_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], st))
    for i in range(70, 100):
        parts.append(OPS.gdn_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], st))
    assert torch.allclose(torch.cat(parts), ref, atol=1e-5, rtol=1e-4)
    assert torch.allclose(st.ssm, whole.ssm, atol=1e-5, rtol=1e-4)


def test_conv_state_carries_across_calls():
    torch.manual_seed(0)
    x, w = torch.randn(11, 8), torch.randn(8, 1, 4)
    whole = OPS.causal_conv1d(x, w, _state())
    st = _state()
    split = torch.cat([OPS.causal_conv1d(x[:6], w, st)] + [OPS.causal_conv1d(x[i:i + 1], w, st) for i in range(6, 11)])
    assert torch.allclose(whole, split, atol=1e-6)
    # against the definition: y_t = silu(sum_j w[c, j] * x[t - 3 + j, c]) with zeros before the start
    padded = torch.cat([torch.zeros(3, 8), x])
    direct = torch.stack([(padded[t:t + 4].T * w[:, 0]).sum(-1) for t in range(11)])
    assert torch.allclose(whole, torch.nn.functional.silu(direct), atol=1e-6)
