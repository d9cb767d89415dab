"""`kiln quantize SRC OUT`: an HF folder or a GGUF file -> a quantised folder in mlx-lm's layout
(docs/quant.md). Every quantised tensor is mx.quantize's (mode "affine"), computed by
kiln/ops/quant/reference.py; a tensor is read, quantised and written a block of rows at a time, so
memory stays near one tensor whatever the model's size."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .. import hub
from ..cli.flags import positive_float
from ..errors import KilnError
from ..ops.quant.reference import BITS, GROUP_SIZES, quantize
from ..tokenizer import Tokenizer
from ..weights import Checkpoint, open_checkpoint

# Families whose mlx-lm model names its weights as HF does (its sanitize only drops a tied lm_head
# and rotary buffers), and whose 2-D `.weight` tensors are all Linear or Embedding modules; and
# Qwen3.5 (dense and MoE), whose sanitize kiln applies as mlx-lm does (qwen3_5_layout).
FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
            "qwen3_next", "gemma4_text")
MLX_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}    # mlx-lm knows only these names
# the norms HF applies as (1 + w): mlx-lm's qwen3_5 sanitize stores them as 1 + w (kiln's reader takes it off)
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")
# parameters a module with submodules holds itself: mlx-lm's index counts only leaf modules' parameters
OWN_PARAMS = ("linear_attn.A_log", "linear_attn.dt_bias", ".layer_scalar", "router.scale", "router.per_expert_scale")
SWITCH = tuple(f"{s}.{n}_proj.weight" for s in ("switch_mlp", "switch_glu") for n in ("gate", "up", "down"))
_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Gemma 4 tensors mlx-lm's sanitize drops (rotary buffers, activation clipping ranges)
GEMMA4_DROPPED = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}
ROUTERS = ("mlp.gate", "shared_expert_gate", "router.proj")     # MoE router gates (--router-bits)
ROUTER_GROUP = 64       # mlx-lm's MoE models quantise their routers at group 64 whatever the model's group
EMBEDDINGS = ("model.embed_tokens", "lm_head")        # --embedding-bits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
_ITEMSIZE = {"U32": 4, **{st: dtype.itemsize for dtype, st in _ST_NAMES.items()}}
_HF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
BLOCK = 1 << 22                # elements quantised at a time (rows are independent: same bits)
SHARD_MB = 5 << 10             # mlx-lm's shard size (5 GiB)


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="convert an HF folder or GGUF file into an mlx-lm quantised folder")
    p.add_argument("src", help="HF folder (config.json + *.safetensors), .gguf file or bundled model name")
    p.add_argument("out", help="output folder (must not exist, or be empty)")
    p.add_argument("--bits", type=int, choices=BITS, default=4, help="bits per weight (default 4)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                   help="weights per scale and bias, along the input dimension (default 64)")
    p.add_argument("--router-bits", type=int, choices=BITS, default=None,
                   help="MoE router gates (mlp.gate, shared_expert_gate, router.proj) at these bits, group 64 "
                        "(as mlx-lm's own conversion)")
    p.add_argument("--embedding-bits", type=int, choices=BITS, default=None,
                   help="embed_tokens (and an untied lm_head) at these bits")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="dtype of scales, biases and unquantised tensors (default: the source's; bf16 from GGUF)")
    p.add_argument("--shard-mb", type=positive_float, default=SHARD_MB, help="max safetensors shard size (MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(main=main)


# -- what to write --------------------------------------------------------------------------------

@dataclass
class Planned:
    """One tensor written (mlx-lm's name and shape) and how: quantised at (bits, group size), or as it
    is; from checkpoint tensor `source` (default: the same name), changed on the way by `how`:
    ("conv",) conv1d's axes [C, 1, K] -> [C, K, 1]; ("offset",) 1 added in the stored dtype;
    ("rows", a, b) rows a:b of each expert of a fused [E, 2I, H] stack (its gate or up half);
    ("stack", names) the per-expert tensors `names` stacked (Qwen3-Next's experts)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype                 # of the tensor written, or of its scales and biases
    fmt: tuple[int, int] | None
    source: str = ""
    how: tuple = ()

    def load(self, ckpt: Checkpoint) -> torch.Tensor:
        if self.how[:1] == ("stack",):
            return torch.stack([ckpt.load(n) for n in self.how[1]])
        w = ckpt.load(self.source or self.name)
        if self.how[:1] == ("conv",):
            return w.movedim(2, 1)
        if self.how[:1] == ("offset",):
            return w + 1.0
        if self.how[:1] == ("rows",):
            return w[:, self.how[1]:self.how[2]]
        return w

    def parts(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of what it becomes: mlx-lm's weight, scales, biases."""
        if self.fmt is None:
            return [(self.name, _ST_NAMES[self.dtype], self.shape)]
        bits, group = self.fmt
        base, (*rows, cols), st = self.name[: -len(".weight")], self.shape, _ST_NAMES[self.dtype]
        return [(f"{base}.weight", "U32", (*rows, cols * bits // 32)), (f"{base}.scales", st, (*rows, cols // group)),
                (f"{base}.biases", st, (*rows, cols // group))]

    def nbytes(self) -> int:
        return sum(math.prod(shape) * _ITEMSIZE[st] for _, st, shape in self.parts())


def module_format(name: str, shape: tuple[int, ...], a) -> tuple[int, int] | None:
    """(bits, group size) for a tensor mlx-lm quantises, None for one it keeps: Linear and Embedding
    weights (2-D `.weight`) and MoE expert stacks (3-D `switch_mlp` ones) whose input dimension the
    group size divides, as quantize_model decides."""
    stack = len(shape) == 3 and name.endswith(SWITCH)
    if not name.endswith(".weight") or (len(shape) != 2 and not stack) or shape[-1] % a.group_size:
        return None
    base = name[: -len(".weight")]
    if a.router_bits and base.endswith(ROUTERS):     # group 64 whatever --group-size, as mlx-lm's predicate
        return (a.router_bits, ROUTER_GROUP) if shape[-1] % ROUTER_GROUP == 0 else None
    if a.embedding_bits and base.removeprefix("language_model.") in EMBEDDINGS:
        return a.embedding_bits, a.group_size
    return a.bits, a.group_size


def open_source(src: str) -> tuple[Checkpoint, dict]:
    """The checkpoint and the config.json to write for it (without `quantization` yet)."""
    if str(src).startswith("synth:"):
        raise KilnError("kiln quantize reads an HF folder or a GGUF file (write a synth: model with kiln synth first)")
    if str(src) in hub.BUNDLED and not Path(src).exists():     # a bundled model's name, as kiln run takes it
        src = hub.ensure(str(src))
    ckpt = open_checkpoint(src)
    if ckpt.format == "hf":
        config = json.loads((ckpt.path / "config.json").read_text())
    else:
        mt = ckpt.config["model_type"]
        config = {k: v for k, v in ckpt.config.items() if v is not None}
        config["architectures"] = [ARCHITECTURES.get(mt, mt)]
    if config.get("model_type") not in FAMILIES:
        raise KilnError(f"kiln quantize does not support model type {config.get('model_type')!r} yet "
                        f"(supported: {', '.join(FAMILIES)})")
    config["model_type"] = MLX_TYPES.get(config["model_type"], config["model_type"])
    if config["model_type"] == "gemma4_text":   # HF's default; mlx-lm's ModelArgs would take a missing one as 20
        config.setdefault("num_kv_shared_layers", 0)
    if config["model_type"] in QWEN35:      # as mlx-lm's ModelArgs renames it in the config it saves
        for c in (config, config.get("text_config") or {}):
            rope = c.get("rope_parameters")
            if isinstance(rope, dict) and "rope_type" in rope and "type" not in rope:
                rope["type"] = rope.pop("rope_type")
    if "quantization" in config or "quantization_config" in config:
        raise KilnError(f"{src} is already quantised (its config.json has a quantization entry)")
    config.pop("_name_or_path", None)
    # written out: mlx-lm's llama takes a silent config as tied, HF as untied
    config.setdefault("tie_word_embeddings", "lm_head.weight" not in ckpt.shapes)
    if eos := ckpt.generation.get("eos_token_id"):     # as mlx-lm's load_config merges it in
        config["eos_token_id"] = eos
    return ckpt, config


def plan(ckpt: Checkpoint, config: dict, a) -> list[Planned]:
    """The tensors mlx-lm's model loads, in the checkpoint's order: a tied lm_head and rotary
    buffers left out (its sanitize drops them), Qwen3.5's as its sanitize leaves them."""
    mt = config["model_type"]
    text = config.get("text_config") or {}
    tied = text.get("tie_word_embeddings", config["tie_word_embeddings"])     # (mlx-lm reads the text model's)
    cast = out_dtype(ckpt, a)
    layout = LAYOUTS.get(mt, lambda name, shape, dtype, ctx: [Planned(name, shape, dtype, None)])
    ctx = Layout(config, expert_ids(ckpt.shapes))
    a = routed_defaults(a, config)
    out = []
    for name, shape in ckpt.shapes.items():
        if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        dtype = _stored_dtype(ckpt, name)
        keep = mt in QWEN35 and name.endswith("A_log")     # (mlx-lm's qwen3_5 cast_predicate keeps A_log's dtype)
        if cast is not None and dtype.is_floating_point and not keep:
            dtype = cast
        for t in layout(name, tuple(shape), dtype, ctx):
            t.fmt = module_format(t.name, t.shape, a) if dtype.is_floating_point else None
            out.append(t)
    return out


@dataclass
class Layout:
    """What a family's layout reads besides the tensor: the config, and each (layer's mlp, projection)'s
    per-expert ids in the checkpoint (Qwen3-Next stores its experts one by one)."""
    config: dict
    experts: dict[tuple[str, str], list[int]]


def expert_ids(shapes: dict) -> dict[tuple[str, str], list[int]]:
    groups: dict[tuple[str, str], list[int]] = {}
    for n in shapes:
        if m := _PER_EXPERT.match(n):
            groups.setdefault((m[1], m[3]), []).append(int(m[2]))
    return {k: sorted(v) for k, v in groups.items()}


def routed_defaults(a, config: dict):
    """`a` with --router-bits 8 where not given for a model with routed experts: mlx-lm's own
    conversion of those families quantises their routers at 8 bits, group 64, whatever -q says."""
    text = config.get("text_config") or config
    experts = text.get("num_experts") or 0
    if a.router_bits is not None or experts <= 0 or config["model_type"] not in ROUTED_TYPES:
        return a
    return argparse.Namespace(**{**vars(a), "router_bits": 8})


def qwen3_5_layout(name: str, shape: tuple[int, ...], dtype: torch.dtype, ctx: Layout) -> list[Planned]:
    """A Qwen3.5 tensor as mlx-lm's sanitize leaves it: under `language_model.`, then as
    gdn_layout."""
    if name.startswith(("model.visual", "visual.", "vision_tower")):
        return []
    return gdn_layout(name, shape, dtype, ctx, "language_model." + name)


def gdn_layout(name: str, shape: tuple[int, ...], dtype: torch.dtype, ctx: Layout,
               out: str | None = None) -> list[Planned]:
    """A Qwen3.5 or Qwen3-Next tensor (written as `out`) as mlx-lm's sanitize leaves it: conv1d
    [C, K, 1]; the (1 + w) norms as 1 + w; a fused expert stack as switch_mlp's gate, up and down
    stacks, per-expert tensors stacked into them (at the first expert's place); the
    multi-token-prediction head dropped."""
    out = out or name
    if "mtp." in name:
        return []
    if name.endswith("conv1d.weight") and len(shape) == 3 and shape[-1] != 1:
        return [Planned(out, (shape[0], shape[2], shape[1]), dtype, None, name, ("conv",))]
    if name.endswith(OFFSET_NORMS) and len(shape) == 1:
        return [Planned(out, shape, dtype, None, name, ("offset",))]
    if name.endswith("mlp.experts.gate_up_proj"):
        return _split_gate_up(out[: -len("experts.gate_up_proj")] + "switch_mlp.", name, shape, dtype)
    if name.endswith("mlp.experts.down_proj"):
        return [Planned(out[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight", shape, dtype, None, name)]
    if m := _PER_EXPERT.match(name):
        if m[2] != "0":
            return []
        names = [f"{m[1]}.experts.{e}.{m[3]}.weight" for e in ctx.experts[m[1], m[3]]]
        stacked = out[: -len(name) + len(m[1])] + f".switch_mlp.{m[3]}.weight"
        return [Planned(stacked, (len(names), *shape), dtype, None, name, ("stack", names))]
    return [Planned(out, shape, dtype, None, name)]


def gemma4_layout(name: str, shape: tuple[int, ...], dtype: torch.dtype, ctx: Layout) -> list[Planned]:
    """A Gemma 4 tensor as mlx-lm's gemma4_text sanitize leaves it: rotary buffers and activation
    ranges dropped, the KV-shared layers' k_proj, v_proj and k_norm dropped (they read an earlier
    layer's K/V), a fused expert stack as switch_glu's gate, up and down stacks."""
    if any(s in name for s in GEMMA4_DROPPED):
        return []
    first_shared = ctx.config["num_hidden_layers"] - (ctx.config.get("num_kv_shared_layers") or 0)
    if any(s in name for s in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")):
        layer = re.search(r"layers\.(\d+)\.", name)
        if layer and int(layer[1]) >= first_shared:
            return []
    if name.endswith(".experts.gate_up_proj"):
        return _split_gate_up(name[: -len("gate_up_proj")] + "switch_glu.", name, shape, dtype)
    if name.endswith(".experts.down_proj"):
        return [Planned(name[: -len("down_proj")] + "switch_glu.down_proj.weight", shape, dtype, None, name)]
    return [Planned(name, shape, dtype, None, name)]


def _split_gate_up(base: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[Planned]:
    """A fused [E, 2I, H] stack as `<base>gate_proj.weight` (rows :I) and `<base>up_proj.weight`."""
    e, rows, cols = shape
    half = rows // 2
    return [Planned(base + "gate_proj.weight", (e, half, cols), dtype, None, name, ("rows", 0, half)),
            Planned(base + "up_proj.weight", (e, half, cols), dtype, None, name, ("rows", half, rows))]


LAYOUTS = {"qwen3_5": qwen3_5_layout, "qwen3_5_moe": qwen3_5_layout, "qwen3_next": gdn_layout,
           "gemma4_text": gemma4_layout}
GDN_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
QWEN35 = ("qwen3_5", "qwen3_5_moe")
ROUTED_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4_text")     # mlx-lm predicates: routers at 8


def out_dtype(ckpt: Checkpoint, a) -> torch.dtype | None:
    """The dtype every float tensor is cast to: --dtype, else bf16 from a GGUF file (its reader
    dequantises to f32), else None (each keeps its stored dtype)."""
    if a.dtype:
        return DTYPES[a.dtype]
    return torch.bfloat16 if ckpt.format == "gguf" else None


def _stored_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    if ckpt.format == "gguf":
        return torch.float32        # what its reader dequantises to
    span = ckpt.locate(name)
    return span.dtype if span is not None else ckpt.load(name).dtype


def quant_config(tensors: list[Planned], a) -> dict:
    """config.json's `quantization`: the defaults, and an entry per module at other bits."""
    quant = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    for t in tensors:
        if t.fmt is not None and t.fmt != (a.bits, a.group_size):
            quant[t.name[: -len(".weight")]] = {"group_size": t.fmt[1], "bits": t.fmt[0]}
    return quant


def shards(tensors: list[Planned], shard_bytes: int) -> list[list[Planned]]:
    """In order, a new shard whenever the next tensor would overflow `shard_bytes` (a module's
    weight, scales and biases stay together)."""
    out, size = [[]], 0
    for t in tensors:
        if out[-1] and size + t.nbytes() > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes()
    return out


# -- writing ---------------------------------------------------------------------------------------

def write_shard(path: Path, tensors: list[Planned], ckpt: Checkpoint, bar) -> None:
    """A safetensors file: the header first (every size is known from the shapes), then each tensor
    a block of rows at a time, each part written at its own offset."""
    header, at = {"__metadata__": {"format": "mlx"}}, 0
    for t in tensors:
        for name, st, shape in t.parts():
            nbytes = math.prod(shape) * _ITEMSIZE[st]
            header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [at, at + nbytes]}
            at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors:
            offsets = [base + header[name]["data_offsets"][0] for name, _, _ in t.parts()]
            write_tensor(f, offsets, t, t.load(ckpt))
            bar.update(1)


def write_tensor(f, offsets: list[int], t: Planned, w: torch.Tensor) -> None:
    """Rows in blocks of about BLOCK elements: cast, quantised where t.fmt says, each part's bytes
    appended at its offset."""
    w = w.reshape(-1, t.shape[-1]) if t.shape else w.reshape(1, 1)
    step = max(1, BLOCK // max(1, w.shape[-1]))
    for r in range(0, w.shape[0], step):
        block = w[r: r + step].to(t.dtype)
        if t.fmt is None:
            parts = [block]
        else:
            q = quantize(block, *t.fmt)
            parts = [q.packed, q.scales, q.biases]
        for k, part in enumerate(parts):
            data = part.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.seek(offsets[k])
            f.write(data)
            offsets[k] += data.nbytes


def write_tokenizer(ckpt: Checkpoint, tmp: Path) -> None:
    """An HF folder's tokenizer files as they are; a GGUF file's tokenizer as the HF files kiln (and
    transformers) read: tokenizer.json, tokenizer_config.json, the chat templates, generation_config.json."""
    if ckpt.format == "hf":
        for name in TOKENIZER_FILES:
            if (ckpt.path / name).is_file():
                shutil.copy2(ckpt.path / name, tmp / name)
        if (ckpt.path / "additional_chat_templates").is_dir():
            shutil.copytree(ckpt.path / "additional_chat_templates", tmp / "additional_chat_templates")
        return
    if "tokenizer.ggml.tokens" not in ckpt.gguf_metadata:
        return      # no tokenizer in the file: token ids in, token ids out
    tok = Tokenizer.from_gguf(ckpt.gguf_metadata)
    tok.backend.save(str(tmp / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    for name, template in tok.templates.items():
        path = tmp / "chat_template.jinja" if name == "default" else tmp / "additional_chat_templates" / f"{name}.jinja"
        path.parent.mkdir(exist_ok=True)
        path.write_text(template, encoding="utf-8")
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_ids}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))


def write_folder(tmp: Path, ckpt: Checkpoint, config: dict, tensors: list[Planned], a) -> int:
    """Shards, index, config.json and tokenizer files into `tmp`; the bytes of the tensors written."""
    parts = shards(tensors, int(a.shard_mb * (1 << 20)))
    weight_map = {}
    with tqdm(total=len(tensors), unit="tensor", desc="quantize", file=sys.stderr, disable=a.quiet) as bar:
        for k, group in enumerate(parts):
            file = "model.safetensors" if len(parts) == 1 else f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
            write_shard(tmp / file, group, ckpt, bar)
            weight_map.update({name: file for t in group for name, _, _ in t.parts()})
    total = sum(t.nbytes() for t in tensors)
    params = sum(math.prod(t.shape) for t in tensors if not t.name.endswith(OWN_PARAMS))
    index = {"metadata": {"total_size": total, "total_parameters": params},
             "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    quant = quant_config(tensors, a)
    config = dict(config, quantization=quant, quantization_config=quant)
    cast = out_dtype(ckpt, a)
    if cast is not None:
        config["torch_dtype"] = _HF_NAMES[cast]
    (tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
    write_tokenizer(ckpt, tmp)
    return total


# -- the command -----------------------------------------------------------------------------------

def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KilnError(f"{out} already exists and is not an empty folder (remove it or choose another)")
    if not out.parent.is_dir():
        raise KilnError(f"no such folder: {out.parent}")


def summary(tensors: list[Planned], src_bytes: int, out_bytes: int, seconds: float) -> str:
    counts: dict[int, int] = {}
    for t in tensors:
        if t.fmt is not None:
            counts[t.fmt[0]] = counts.get(t.fmt[0], 0) + 1
    quantised = ", ".join(f"{n} at {b} bits" for b, n in sorted(counts.items())) or "none"
    kept = sum(t.fmt is None for t in tensors)
    bpw = out_bytes * 8 / max(1, sum(math.prod(t.shape) for t in tensors))
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
    return (f"kiln: quantised modules: {quantised}; {kept} tensors kept; {mib(src_bytes)} -> {mib(out_bytes)} "
            f"({bpw:.2f} bits per weight) in {seconds:.1f} s")


def main(a) -> int:
    t0 = time.perf_counter()
    out = Path(a.out).expanduser()
    check_out(out)
    ckpt, config = open_source(a.src)
    tensors = plan(ckpt, config, a)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tmp.chmod(0o777 & ~_umask())        # mkdtemp's 0700 would become OUT's mode
        out_bytes = write_folder(tmp, ckpt, config, tensors, a)
        check_out(out)      # nobody wrote there meanwhile
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not a.quiet:
        print(summary(tensors, source_bytes(ckpt), out_bytes, time.perf_counter() - t0), file=sys.stderr)
    print(out)
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def source_bytes(ckpt: Checkpoint) -> int:
    """The size of the weights read: the GGUF file, or the folder's safetensors files."""
    files = [ckpt.path] if ckpt.path.is_file() else ckpt.path.glob("*.safetensors")
    return sum(f.stat().st_size for f in files)
