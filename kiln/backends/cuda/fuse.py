"""Projections that read the same input, concatenated into one weight so that one GEMM serves them
(at decode, one launch instead of two to four: q|k|v, the GDN in_proj qkv|z|b|a, an MLP's gate|up).

The model's weights become views into the concatenated tensor, so memory does not grow and the
reference ops, which see the views, compute exactly what they did.
"""

from __future__ import annotations

import torch

# Weight-name suffixes that form a group, in output order; a group needs all its members.
GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
     "linear_attn.in_proj_a.weight"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
)


def projection_groups(shapes: dict[str, tuple]) -> list[tuple[str, ...]]:
    """Groups of weight names (present, 2-D, same input width) to concatenate, from the name -> shape map."""
    out = []
    for name in shapes:
        for group in GROUPS:
            if not name.endswith(group[0]):
                continue
            prefix = name[: -len(group[0])]
            names = tuple(prefix + g for g in group)
            dims = [shapes.get(n) for n in names]
            if all(d is not None and len(d) == 2 and d[1] == dims[0][1] for d in dims):
                out.append(names)
    return out


def concatenate(weights: dict[str, torch.Tensor], groups) -> dict[tuple, torch.Tensor]:
    """Replace each group's weights by row views of one concatenated tensor; returns
    {(view data pointers): concatenated weight} for `linear_split`."""
    fused = {}
    for names in groups:
        ws = [weights[n] for n in names]
        if len({(w.dtype, w.device) for w in ws}) != 1:
            continue
        cat = torch.cat(ws, dim=0)
        start = 0
        for n, w in zip(names, ws):
            weights[n] = cat[start:start + w.shape[0]]
            start += w.shape[0]
        fused[tuple(weights[n].data_ptr() for n in names)] = cat
    return fused
