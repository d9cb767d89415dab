"""kiln's Gated DeltaNet kernels against flash-linear-attention's chunk_gated_delta_rule: error, then time.

    PYTHONPATH=. python3 bench/gdn_gpu.py OUT.json     (GPU; fla from pip install flash-linear-attention)

Prefill at T = 8192 and 32768 for 16 and 32 value heads (16 key heads, dk = dv = 128, K = 4):
  - chunk: kiln's chunked rule (prep + scan, gated norm fused or as a pass) on the conv output, vs
    fla.ops.gated_delta_rule.chunk_gated_delta_rule (0.6.0; q/k l2-normalised in its kernel, q/k
    repeated to the value heads, [B, T, H, D] layout) on the same inputs; both checked against each
    other (y after the gated norm, and the final state);
  - whole: kiln's gdn_prefill (conv + chunk + norm).
Decode: every gdn_decode variant per layer, GB/s of state traffic (ssm read + written, f32).
Times: kiln.tune.timing (CUDA-graph replays, warm-up, median). Each case records its own failure.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from kiln.backends.reference import ReferenceOps
from kiln.ops.gdn import kernels as gdn
from kiln.tools.benchutil import environment, now_iso
from kiln.tune.device import device_info
from kiln.tune.timing import time_ms

DEV = torch.device("cuda")
HK, DK, DV, K = 16, 128, 128, 4
BUDGET_S = 100.0
REF_FORM = gdn.chunk_variant(32, 8, "ieee", 8)      # the f32 form that compiles on Triton 3.6 (sm_90)
CHUNK_FORMS = [REF_FORM] + gdn.split_forms(DV)[:2]


def inputs(t: int, hv: int) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(t + hv)
    return gdn.gdn_inputs(gdn.GdnShape(t, HK, hv, DK, DV, K), torch.bfloat16, DEV, gen)


def fla_call(fla, inp, xc, hv):
    """fla's chunk rule on kiln's conv output; returns y (after the same gated norm) and the final state."""
    t, rep = xc.shape[0], hv // HK
    q, k, v = xc.split([HK * DK, HK * DK, hv * DV], dim=-1)
    q, k = (x.view(1, t, HK, DK).repeat_interleave(rep, dim=2).contiguous() for x in (q, k))
    v = v.reshape(1, t, hv, DV).contiguous()
    g = (-inp["A_log"].float().exp() * torch.nn.functional.softplus(inp["a"].float() + inp["dt_bias"].float()))[None]
    beta = torch.sigmoid(inp["b"])[None]

    def run():
        return fla(q, k, v, g.contiguous(), beta.contiguous(), scale=DK ** -0.5, initial_state=inp["ssm"].clone()[None],
                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    return run


def rel(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)


def prefill_case(t: int, hv: int, fla) -> dict:
    inp = inputs(t, hv)
    dims = inp["dims"]
    row = {"T": t, "hv": hv, "hk": HK, "dk": DK, "dv": DV}
    conv = inp["conv_state"].clone()
    xc = gdn.conv(inp["qkv"], inp["conv_w"], conv)
    args = [inp[n] for n in ("z", "b", "a", "A_log", "dt_bias", "norm_w")]
    ref_y = torch.empty((t, hv * DV), dtype=torch.bfloat16, device=DEV)
    ref_s = inp["ssm"].clone()
    gdn.chunked(xc, *args, ref_s, dims, ref_y, REF_FORM.p)
    row["kiln"] = {}
    for v in CHUNK_FORMS:
        try:
            y, s = torch.empty_like(ref_y), inp["ssm"].clone()
            gdn.mix(xc, *args, s, dims, v, y)
            err = {"y_rel_err_vs_ieee": rel(y, ref_y), "ssm_rel_err_vs_ieee": rel(s, ref_s)}
            ms = time_ms([lambda: gdn.mix(xc, *args, s, dims, v, y)], DEV)
            row["kiln"][v.name] = {"chunk_ms": ms, **err}
        except Exception as e:  # noqa: BLE001
            row["kiln"][v.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        v = gdn.PREFILL.default(gdn.GdnShape(t, HK, hv, DK, DV, K), device_info(DEV))
        pre = [inp[n] for n in gdn.ARGS]
        cs, s = inp["conv_state"].clone(), inp["ssm"].clone()
        row["whole_variant"] = v.name
        row["whole_ms"] = time_ms([lambda: gdn.gdn_prefill(*pre, cs, s, dims, v)], DEV)
    except Exception as e:  # noqa: BLE001
        row["whole_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if fla is None:
        row["fla"] = "fla unavailable"
        return row
    try:
        run = fla_call(fla, inp, xc, hv)
        o, final = run()
        y = ReferenceOps(DEV).gated_rmsnorm(o[0].to(torch.bfloat16), inp["z"].view(t, hv, DV), inp["norm_w"], 1e-6)
        row["fla"] = {"chunk_ms": time_ms([run], DEV), "y_rel_err_kiln_vs_fla": rel(ref_y, y.reshape(t, hv * DV)),
                      "ssm_rel_err_kiln_vs_fla": rel(ref_s, final[0].float())}
    except Exception as e:  # noqa: BLE001
        row["fla"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row


def decode_case(hv: int) -> dict:
    inp = inputs(1, hv)
    dims = inp["dims"]
    state_bytes = 2 * hv * DK * DV * 4
    row = {"hv": hv, "state_bytes_rw": state_bytes, "variants": {}}
    pre = [inp[n] for n in gdn.ARGS]
    want_c, want_s = inp["conv_state"].clone(), inp["ssm"].clone()
    want = gdn.gdn_decode(*pre, want_c, want_s, dims, gdn.UNFUSED)
    for v in gdn.DECODE.catalogue(gdn.GdnShape(1, HK, hv, DK, DV, K), device_info(DEV)):
        try:
            cs, s = inp["conv_state"].clone(), inp["ssm"].clone()
            y = gdn.gdn_decode(*pre, cs, s, dims, v)
            err = {"y_rel_err": rel(y, want), "ssm_rel_err": rel(s, want_s),
                   "conv_equal": bool(torch.equal(cs, want_c))}
            ms = time_ms([lambda: gdn.gdn_decode(*pre, cs, s, dims, v)], DEV)
            row["variants"][v.name] = {"ms": ms, "state_GBps": state_bytes / ms / 1e6, **err}
        except Exception as e:  # noqa: BLE001
            row["variants"][v.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row


def main(out: str) -> None:
    t0 = time.time()
    try:
        import fla as fla_pkg
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        fla_version = getattr(fla_pkg, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fla, fla_version = None, f"fla unavailable ({type(e).__name__}: {e})"
    res = {"date": now_iso(), **environment(DEV), "fla": fla_version, "dtype": "bf16",
           "command": " ".join(sys.argv), "prefill": [], "decode": [], "skipped": []}

    def save():
        with open(out, "w") as f:
            json.dump(res, f, indent=1)

    for hv in (16, 32):
        try:
            res["decode"].append(decode_case(hv))
        except Exception:  # noqa: BLE001
            res["decode"].append({"hv": hv, "error": traceback.format_exc()[-1500:]})
        save()
    for t in (8192, 32768):
        for hv in (16, 32):
            if time.time() - t0 > BUDGET_S:
                res["skipped"].append({"T": t, "hv": hv, "why": "time budget"})
                continue
            try:
                res["prefill"].append(prefill_case(t, hv, fla))
            except Exception:  # noqa: BLE001
                res["prefill"].append({"T": t, "hv": hv, "error": traceback.format_exc()[-1500:]})
            save()
    res["wall_s"] = round(time.time() - t0, 1)
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gdn_gpu.json")
