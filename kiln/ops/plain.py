"""The kernels outside the tuner (nothing to measure): the greedy choice, the RoPE tables (where on), the
routers, the shared expert's gate, Gemma's GELU, the GDN's unpacking of its packed projection. Unwarmed, a
cold start compiled them at its first prefill or decode step (Gemma 4: six kernels, ~2 s of its first
prefill on the H200). The cuda backend compiles them on a thread while the weights load (`warm`);
tools/cross_compile.py compiles them for another GPU. Each is launched once, at the model's shapes, on
small stand-ins that keep each kernel's contract (finite values, distinct expert ids): the kernels
specialise on widths and dtypes, not on rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .gdn import unpack
from .gemm import gelu
from .moe import kernels as moe
from .moe import router
from .rope import tables as rope_tables
from .sample import kernels as sample


def plain_kernels(cfg, dtype: torch.dtype, device: torch.device) -> list[tuple[str, Callable]]:
    """(name, launch) of the untuned kernels a model of config `cfg` runs."""
    def empty(*shape):      # zeros, not torch.empty: NaN logits would send a top-k's ids out of range
        return torch.zeros(*shape, dtype=dtype, device=device)

    one, h = torch.zeros(1, dtype=torch.long, device=device), cfg.hidden_size
    out = [("greedy", lambda: sample.greedy_next(empty(cfg.vocab_size), one, one.clone()))]
    if rope_tables.tables_on():         # every family's RoPE tables (one compile a dtype: widths are runtime values)
        out.append(("rope_tables", lambda: rope_tables.rope_tables(one, torch.ones(1, device=device), dtype)))
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):       # the GDN's packed inputs
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        widths = [2 * hk * dk + hv * dv, hv * dv, hv, hv]

        def gdn_unpack(padded: bool):
            parts = torch.split(empty(2, sum(widths)), widths, dim=1)
            unpack.unpack(*parts, one if padded else None, -1.0e4)
        out += [("gdn_unpack", lambda: gdn_unpack(False)), ("gdn_unpack_padded", lambda: gdn_unpack(True))]
    if getattr(cfg, "hidden_activation", None) == "gelu_pytorch_tanh":      # Gemma's MLP
        wide = getattr(cfg, "use_double_wide_mlp", False)
        for n in sorted({cfg.intermediate_size, 2 * cfg.intermediate_size if wide else cfg.intermediate_size}):
            out.append((f"gelu_mul_{n}", lambda n=n: gelu.gelu_mul(empty(1, n), empty(1, n))))
    if getattr(cfg, "enable_moe_block", False):                              # Gemma 4's router
        e, k = cfg.num_experts, cfg.top_k_experts
        out += [("scaled_topk", lambda: router.scaled_topk(empty(1, e), empty(e), k)),
                ("router_gemv_topk", lambda: router.router_scaled_topk(empty(1, h), empty(e, h), empty(e), k))]
    elif getattr(cfg, "num_experts", None) and getattr(cfg, "num_experts_per_tok", None):     # Qwen's
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        x = empty(1, h)
        out += [("router", lambda: router.router_topk(empty(1, e), k)),
                ("router_linear_topk", lambda: router.router_linear_topk(empty(1, h), empty(e, h), k,
                                                                         getattr(cfg, "norm_topk_prob", True))),
                ("shared_gate", lambda: moe.shared_gate_add(x, x, empty(1, h), x)),
                # distinct ids, as combine assumes: k equal ids made it read row 0+1+..+(k-1) of y's k rows,
                # past the allocation (an illegal address when y ended a segment)
                ("gated_combine", lambda: moe.combine(empty(k, h), torch.arange(k, device=device).view(1, k),
                                                      empty(1, h), x, (empty(1, h), x)))]
    return out


def warm(cfg, dtype: torch.dtype, device: torch.device, log: Callable[[str], None] | None = None) -> threading.Thread:
    """Compile (by launching once) every plain kernel of `cfg` on a daemon thread; join it before the
    model runs. A failure here is only logged (the rest are not warmed): a first real launch compiles."""
    def run():
        name = "list"
        try:            # a warm-up, never a reason to fail the load
            with torch.cuda.device(device):
                for name, launch in plain_kernels(cfg, dtype, device):
                    launch()
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001
            if log:
                log(f"[kiln] warning: plain kernels not warmed, at {name} ({type(e).__name__}: {e})")

    thread = threading.Thread(target=run, name="kiln-warm-plain", daemon=True)
    thread.start()
    return thread
