"""What every model file shares: config from a dict, strict weight loading with packed projections
merged, the Model base (the facts a model declares about itself), and KernelShape."""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..cache import KVCache, StateBatch, paged, stage, unstage
from ..errors import KilnError
from ..indexcheck import checked
from ..weights.checkpoint import FileSpan
from ..weights.quantized import cat_rows
from ..weights.upload import Uploader, file_reads_on, pinned_upload_on, placed


def per_request(state, fn, *rows, whole=None):
    """fn(state, *rows) for one request's state; for a StateBatch, whole(state, *rows) where it is given
    and runs the batch at once (a backend's batched decode kernel; None where it cannot), else fn once
    per request on its rows of each row tensor (None passes through: one row each, or `state.rows`
    of them for several prompts prefilled together), the outputs concatenated along rows in batch
    order."""
    if not isinstance(state, StateBatch):
        return _alone(fn, state, *rows)
    if state.rows is None and whole is not None and (out := whole(state, *rows)) is not None:
        return out
    if state.whole_only:
        raise KilnError("an op of this batched step runs request by request: it cannot be captured")
    spans = state.spans()
    outs = [_alone(fn, s, *(None if r is None else r[a:b] for r in rows)) for s, (a, b) in zip(state, spans)]
    return torch.cat(outs)


def _alone(fn, layer, *rows):
    """fn over one request's layer state; a pool slot's paged K/V (kiln.cache.PagedKV) on a contiguous
    copy of its positions, the positions it gains written back to its pages after."""
    if not paged([layer]):
        return fn(layer, *rows)
    new = next((r.shape[0] for r in rows if isinstance(r, torch.Tensor)), 1)
    staged, = stage([layer], layer.length + new)
    try:
        return fn(staged, *rows)
    finally:
        unstage([layer], [staged])


def last_rows(x: torch.Tensor, last_only) -> torch.Tensor:
    """The rows whose logits are asked for: the last `last_only` (True: the last one), the rows a
    tensor of indices names (each prompt's last, several prefilled together), or all (False)."""
    if isinstance(last_only, torch.Tensor):
        return x.index_select(0, checked(last_only, x.shape[0], "last_rows"))
    return x[-last_only:] if last_only else x


def config_from_dict(cls, d: dict[str, Any]):
    """Fill dataclass `cls` from an HF config dict, keeping only the keys it knows."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise KilnError(f"model config lacks {', '.join(missing)}")
    return cls(**{k: v for k, v in d.items() if k in names})


def load_strict(ckpt, expected: dict[str, tuple[int, ...]], dtype, device, tied: tuple[str, ...] = (),
                progress: bool = False, skip: frozenset = frozenset()):
    """Tensors for exactly the `expected` names: anything missing, extra or mis-shaped is an error.
    `tied` names may be absent (they alias another weight); `skip` names are checked, not loaded
    (the expert store's)."""
    extra = sorted(set(ckpt.shapes) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise KilnError(f"unexpected tensor in checkpoint: {extra[0]}{more}")
    uploader = Uploader(device) if pinned_upload_on(device) else None
    weights = {}
    try:
        for name, shape in tqdm(expected.items(), desc="load", unit="tensor", disable=not progress, file=sys.stderr,
                                leave=False):
            if name not in ckpt.shapes:
                if name in tied:
                    continue
                raise KilnError(f"missing tensor in checkpoint: {name}")
            if tuple(ckpt.shapes[name]) != tuple(shape):
                raise KilnError(f"tensor {name} has shape {tuple(ckpt.shapes[name])}, expected {tuple(shape)}")
            if name not in skip:
                weights[name] = _load_one(ckpt, name, dtype, device, uploader)
    finally:
        if uploader is not None:
            uploader.finish()
    return weights


def _load_one(ckpt, name: str, dtype, device, uploader):
    """One tensor on `device` in `dtype`: read from its file into pinned buffers where the checkpoint
    can say where its bytes lie, else through the reader (a view of the file's memory map)."""
    if uploader is not None and file_reads_on() and isinstance(span := ckpt.locate(name), FileSpan):
        return uploader.upload_span(span, dtype)
    return placed(ckpt.load(name), dtype, device, uploader)


def merge_packed(weights: dict[str, torch.Tensor], groups: dict[str, list[str]]) -> None:
    """Each group's parts replaced, in place, by one tensor of their rows in order (one GEMM serves
    them all); a part's memory is freed as soon as it is copied."""
    for merged, parts in groups.items():
        weights[merged] = cat_rows([weights[n] for n in parts])
        for n in parts:
            del weights[n]


def eos_ids(config: dict, generation: dict) -> list[int]:
    """End-of-sequence ids named by generation_config (preferred) or config."""
    ids: list[int] = []
    for src in (generation.get("eos_token_id"), config.get("eos_token_id")):
        for i in ([src] if isinstance(src, int) else src or []):
            if i not in ids:
                ids.append(i)
    return ids


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacks_to_fused(ckpt, stack: str, fused: str):
    """mlx-lm's expert stacks (`<stack>{gate,up,down}_proj.weight`, [E, rows, cols] each, quantised or
    not: Qwen's `mlp.switch_mlp.`, Gemma 4's `experts.switch_glu.`) as kiln's fused layout:
    `<fused>gate_up_proj` (each expert's gate rows, then its up rows) and `<fused>down_proj`. Other
    checkpoints pass through."""
    gates = [n for n in ckpt.shapes if n.endswith(stack + "gate_proj.weight")]
    if not gates:
        return ckpt
    shapes, parts = dict(ckpt.shapes), {}
    for gate in gates:
        layer = gate[: -len(stack + "gate_proj.weight")]
        up, down = layer + stack + "up_proj.weight", layer + stack + "down_proj.weight"
        e, i, h = shapes.pop(gate)
        shapes.pop(up)
        shapes[layer + fused + "gate_up_proj"] = (e, 2 * i, h)
        shapes[layer + fused + "down_proj"] = shapes.pop(down)
        parts[layer + fused + "gate_up_proj"], parts[layer + fused + "down_proj"] = (gate, up), (down,)

    def load(name: str):
        if name not in parts:
            return ckpt.load(name)
        return cat_rows([ckpt.load(n) for n in parts[name]]) if len(parts[name]) > 1 else ckpt.load(parts[name][0])

    return dataclasses.replace(ckpt, shapes=shapes, loader=load, locator=None, located=None)


def fuse_experts(ckpt):
    """Per-expert checkpoint names (`experts.{e}.gate_proj.weight`, ...) -> the fused layout the
    models use (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]).
    Fused checkpoints pass through unchanged."""
    groups: dict[str, dict[int, dict[str, str]]] = {}
    for name in ckpt.shapes:
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = name
    if not groups:
        return ckpt
    shapes = {n: s for n, s in ckpt.shapes.items() if not _EXPERT.match(n)}
    parts: dict[str, list] = {}
    for prefix, experts in groups.items():
        count = max(experts) + 1
        for e in range(count):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if kind not in experts.get(e, {}):
                    raise KilnError(f"missing tensor in checkpoint: {prefix}.{e}.{kind}.weight")
        gate, down = ckpt.shapes[experts[0]["gate_proj"]], ckpt.shapes[experts[0]["down_proj"]]
        shapes[f"{prefix}.gate_up_proj"] = (count, 2 * gate[0], gate[1])
        shapes[f"{prefix}.down_proj"] = (count, *down)
        parts[f"{prefix}.gate_up_proj"] = [(experts[e]["gate_proj"], experts[e]["up_proj"]) for e in range(count)]
        parts[f"{prefix}.down_proj"] = [(experts[e]["down_proj"],) for e in range(count)]

    def load(name):
        if name not in parts:
            return ckpt.load(name)
        return torch.stack([torch.cat([ckpt.load(n) for n in names]) for names in parts[name]])

    def locate(name):
        return None if name in parts else ckpt.locate(name)

    return dataclasses.replace(ckpt, shapes=shapes, loader=load, locator=locate, located=load)


def decoder_layer_shapes(c, extra_attn: dict | None = None) -> dict[str, tuple[int, ...]]:
    """One dense decoder layer's attention and gated-MLP weights (names relative to the layer)."""
    h, d, f = c.hidden_size, c.head_dim, c.intermediate_size
    shapes = {"self_attn.q_proj.weight": (c.num_attention_heads * d, h),
              "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
              "self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
              "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    return {**shapes, **(extra_attn or {})}


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One shape a kernel runs for a model, in its op's terms: `op` names a tuned op
    (kiln.tune.registry: "gemm", "rmsnorm", ...), `dims` its shape's fields. The cuda backend tunes
    each one at load; a model declares them from its config alone (`kiln tune` loads no weights)."""
    op: str
    dims: tuple[tuple[str, Any], ...]


def kernel(op: str, **dims) -> KernelShape:
    return KernelShape(op, tuple(dims.items()))


def gemms(rows, *nk: tuple[int, int]) -> list[KernelShape]:
    """Projections y[m, n] = x[m, k] @ w[n, k]^T at each row count."""
    return [kernel("gemm", rows=m, n=n, k=k) for m in rows for n, k in nk]


def norms(rows, d: int, style: str, per_row: int = 1) -> list[KernelShape]:
    """RMSNorm over d at each row count (times `per_row` heads for a per-head q/k norm)."""
    return [kernel("rmsnorm", rows=m * per_row, d=d, style=style) for m in rows]


def gated_mlp_shapes(rows, hidden: int, ffn: int, act: str, style: str, norm_inside: bool) -> list[KernelShape]:
    """A gated MLP: gate|up as one GEMM (or with its activation in the epilogue), the down projection;
    at decode also the down projection reading act(g) * u as it loads, and with `norm_inside` the
    residual add and the post-attention norm inside the gate|up GEMV."""
    out = gemms(rows, (2 * ffn, hidden), (hidden, ffn))
    out += [kernel("gemm_act", rows=m, n=ffn, k=hidden, act=act) for m in rows]
    if 1 in rows:
        out.append(kernel("act_gemm", rows=1, n=hidden, k=ffn, act=act))
        if norm_inside:
            out.append(kernel("rmsnorm_gemm", rows=1, n=2 * ffn, k=hidden, style=style, add=True))
    return out


def attention_shapes(rows, contexts, heads: int, kv: int, d: int, rotary: int, qk_style: str | None) -> list:
    """Causal attention at each prompt chunk and, at decode, at each context length; the q/k norm +
    RoPE + KV append in front of it."""
    out = [kernel("qk_rope", rows=m, h=heads, kv=kv, d=d, r=rotary, style=qk_style) for m in rows]
    for m in rows:
        if m == 1:
            out += [kernel("attention_decode", rows=n, h=heads, kv=kv, d=d, window=None, softcap=None)
                    for n in contexts]
        else:
            out.append(kernel("attention", rows=m, h=heads, kv=kv, d=d, window=None, softcap=None, kv_prefix=0))
    return out


def lm_head_shapes(vocab: int, hidden: int, style: str) -> list[KernelShape]:
    """The LM head runs for the last row only (prefill keeps the last token), the final norm before it."""
    return gemms((1,), (vocab, hidden)) + [kernel("rmsnorm_gemm", rows=1, n=vocab, k=hidden, style=style)]


class Model:
    """A model family: `weight_shapes` declares the checkpoint, `forward` is calls to `ops`, and the
    class states every other fact a backend, the loader or the tuner needs about it."""

    config_class: type
    # How its RMSNorm scales the normed value (kiln.ops.norm.reference): "llama" casts then multiplies
    # by w; "offset" multiplies by (1 + w) in f32 (the weights are stored zero-centred); "plain" by w in f32.
    norm_style: str = "llama"
    # Projections of one input merged at load into one weight (one GEMM runs them): a merged weight's
    # name within a layer -> the checkpoint names it packs, in row order. A layer lacking a part keeps
    # its weights apart; a part two groups name goes to the first (in this order) whose parts all exist.
    packed: dict[str, tuple[str, ...]] = {}
    # Called after each layer of a forward when set: kiln.engine.Batch launches a decode step of its
    # running requests there while the host is still issuing a prompt's prefill.
    between_layers: Callable[[], None] | None = None
    # forward takes several prompts' rows at once (StateBatch.rows; last_only a tensor of row indices)
    several_prompts = False

    def __init__(self, cfg, weights: dict[str, torch.Tensor], ops):
        self.cfg, self.w, self.ops = cfg, weights, ops

    def layer_done(self) -> None:
        if self.between_layers is not None:
            self.between_layers()

    @classmethod
    def weight_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @classmethod
    def tied_names(cls, cfg) -> tuple[str, ...]:
        """Names a checkpoint may omit because they alias another weight (a tied LM head)."""
        return ("lm_head.weight",) if getattr(cfg, "tie_word_embeddings", False) else ()

    @classmethod
    def checkpoint_shapes(cls, cfg) -> dict[str, tuple[int, ...]]:
        """The tensors a checkpoint of this model holds (tied weights left out): what synthesis writes."""
        tied = set(cls.tied_names(cfg))
        return {n: tuple(int(d) for d in s) for n, s in cls.weight_shapes(cfg).items() if n not in tied}

    @classmethod
    def packed_groups(cls, cfg) -> dict[str, list[str]]:
        """Merged weight name -> the declared weights it packs, layer by layer (see `packed`)."""
        shapes, groups = cls.weight_shapes(cfg), {}
        for i in range(cfg.num_hidden_layers):
            p, taken = f"model.layers.{i}.", set()
            for merged, parts in cls.packed.items():     # the first group that holds a part takes it
                if all(p + n in shapes for n in parts) and not taken & set(parts):
                    groups[p + merged] = [p + n for n in parts]
                    taken |= set(parts)
        return groups

    @classmethod
    def sanitize(cls, ckpt):
        """Checkpoint quirks, mapped to the names `weight_shapes` declares (default: none)."""
        return ckpt

    @classmethod
    def kernel_shapes(cls, cfg, rows: tuple[int, ...], contexts: tuple[int, ...]) -> list[KernelShape]:
        """The shapes its kernels run at `rows` tokens a step (prompt chunks and decode's 1), decode
        attention at `contexts` keys: what the cuda backend tunes at load."""
        raise NotImplementedError

    def make_state(self, dtype, device) -> list:
        raise NotImplementedError

    def kv_cache(self, n_kv: int, head_dim: int, dtype, device, window: int | None = None) -> KVCache:
        """An attention layer's cache in the layout its backend reads best (`ops.head_major_kv`); `window`:
        a sliding-window layer's, only its last `window` positions ever read (KVCache.window): a ring of
        them on a backend whose kernels take one (`ops.window_cache`)."""
        make = getattr(self.ops, "window_cache", None)
        ring = make(n_kv, head_dim, window, dtype, device) if window is not None and make is not None else None
        if ring is not None:
            return ring
        cache = KVCache(n_kv, head_dim, dtype, device, head_major=getattr(self.ops, "head_major_kv", False))
        cache.window = window
        return cache

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, state: list, last_only: bool | int = True):
        """Logits of the last row (True), of the last n rows (an int n >= 1), or of every row (False):
        the LM head runs only for those rows."""
        raise NotImplementedError
