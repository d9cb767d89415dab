"""What every `kiln` command shares: argparse types, the flags of a command that loads a model or
samples from it, and loading a model from those flags."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..api import LLM, load
from ..errors import KilnError
from ..fsutil import write_atomic
from ..sampling import SamplingParams


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too)
        raise KilnError(message)


def bounded_int(lo: int, what: str):
    """An argparse type: an integer >= lo, or the error "expected {what}"."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


positive_int = bounded_int(1, "a positive integer")


def positive_int_list(s: str) -> list[int]:
    """"N,N,...": distinct positive integers, sorted (prompt lengths, concurrency levels)."""
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return sorted(set(vals))
nonneg_int = bounded_int(0, "an integer >= 0")


def at_least(lo: int):
    return bounded_int(lo, f"an integer >= {lo}")


def finite(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def positive_float(s: str) -> float:
    v = finite(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def token_ids(s: str) -> list[int]:
    """`--prompt-ids 1,2,3`."""
    try:
        ids = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {s!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids >= 0, got {s!r}")
    return ids


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (run, chat, serve, bench, ...)."""
    p.add_argument("model", nargs="?", default=None,
                   help="a path (HF folder or .gguf), a bundled model name, or "
                        "synth:NAME[:layers=N][:seed=S][:bits=B...] (docs/synth.md)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None,
                   help="weights and activations (default: bf16 on GPU, f32 on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu", "reference"],
                   help="kernels: cuda (Triton, tuned at load), cpu (quantised weights kept quantised, "
                        "forms measured at load) or reference (plain torch); auto (default) = cuda on a GPU, "
                        "cpu for a GGUF file on the CPU, reference otherwise")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda backend: run decode steps eagerly, not as a CUDA graph")
    p.add_argument("--max-context", type=at_least(2), default=None, help="cap on prompt + generated tokens")
    p.add_argument("--retune", action="store_true", help="cuda backend: measure kernels again even on a cache hit")
    p.add_argument("--tune", action="append", default=[], metavar="OP=VARIANT",
                   help="cuda backend: pin a kernel variant for every shape of OP (repeatable)")
    p.add_argument("--verify", choices=["full", "lazy", "off"], default="lazy",
                   help="a packed model's files against its manifest's SHA-256: all at load, each on first "
                        "use (default), or not at all")
    p.add_argument("--quiet", action="store_true", help="print nothing on stderr")
    add_expert_flags(p)


def add_expert_flags(p: argparse.ArgumentParser) -> None:
    """Expert streaming (docs/streaming.md): on with --expert-cache-slots or --expert-policy, or when
    --gpu-memory cannot hold every expert (on CUDA with none of these: when the weights pass the free memory)."""
    g = p.add_argument_group("device memory and expert streaming (MoE models)")
    g.add_argument("--gpu-memory", type=positive_float, default=None, metavar="GB",
                   help="device memory kiln may use: core weights, KV cache for --max-context, workspace and "
                        "as many expert slots as fit (every expert resident if they all do)")
    g.add_argument("--expert-cache-slots", type=positive_int, default=None, metavar="N",
                   help="stream the routed experts, N of each layer's cached on the device (default 16)")
    g.add_argument("--expert-policy", choices=["lfu", "lru", "static", "os"], default=None,
                   help="which experts the slots keep (default lfu; static needs --expert-profile)")
    g.add_argument("--expert-home", choices=["auto", "host", "disk"], default="auto",
                   help="where streamed experts live: host memory, or disk (a packed directory); auto: host "
                        "unless they pass --host-memory (default: 75%% of the available host memory; disk then needs a "
                        "packed directory)")
    g.add_argument("--host-memory", type=finite, default=None, metavar="GB",
                   help="host memory the streamed experts may take (auto home: disk beyond it)")
    g.add_argument("--io-threads", type=positive_int, default=8, metavar="N", help="parallel expert reads (default 8)")
    g.add_argument("--direct-io", action="store_true",
                   help="read experts homed on disk with O_DIRECT, past the page cache (default: through it)")
    g.add_argument("--zero-copy", choices=["auto", "on", "off"], default="auto",
                   help="experts homed in host memory: the decode kernels read misses there in place, no "
                        "copy first (auto: on a CUDA device; off copies each miss into a slot)")
    g.add_argument("--expert-profile", default=None, metavar="FILE",
                   help="routing counts (JSON, as --save-expert-profile writes) for the static policy")
    g.add_argument("--save-expert-profile", default=None, metavar="FILE",
                   help="run, bench: write the run's routing counts (use per layer and expert) to FILE at the end")


def add_sampling_flags(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-new", type=positive_int, default=256, help="max new tokens (default 256)")
    p.add_argument("--temperature", type=finite, default=temperature, help=f"0 = greedy (default {temperature})")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="0 = off")
    p.add_argument("--top-p", type=finite, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=finite, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=finite, default=1.0, help="1 = off")
    p.add_argument("--seed", type=nonneg_int, default=None, help="same seed, same sampled text")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); excluded from the output")


def sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=tuple(a.stop))


def sampling_params(a) -> SamplingParams:
    """The sampling flags as SamplingParams, checked by its own rules now: a bad value is refused
    before the model loads, not after."""
    params = SamplingParams(**sampling_kwargs(a))
    params.validate()
    return params


def parse_pins(items: list[str]) -> dict[str, str]:
    """`--tune OP=VARIANT` flags -> {op: variant} (the tuner checks that both exist)."""
    pins = {}
    for item in items:
        op, sep, name = item.partition("=")
        if not sep or not op or not name:
            raise KilnError(f"--tune takes OP=VARIANT, got {item!r}")
        pins[op] = name
    return pins


def load_from_flags(a, check=None) -> LLM:
    """kiln.load with the runtime flags of `add_runtime_flags`; `check(tokenizer)` as kiln.load takes it."""
    if getattr(a, "save_expert_profile", None) and (a.expert_cache_slots, a.expert_policy, a.gpu_memory) == (None,) * 3:
        raise KilnError("--save-expert-profile records a streamed run: give --expert-cache-slots, --expert-policy "
                        "or --gpu-memory")
    return load(a.model, device=a.device, dtype=a.dtype, backend=a.backend, max_context=a.max_context,
                quiet=a.quiet, retune=a.retune, tune=parse_pins(a.tune), enforce_eager=a.enforce_eager,
                check=check, verify=getattr(a, "verify", "lazy"), expert_cache_slots=a.expert_cache_slots,
                expert_policy=a.expert_policy, expert_home=a.expert_home, host_memory=a.host_memory,
                io_threads=a.io_threads, expert_profile=a.expert_profile, direct_io=a.direct_io,
                zero_copy=a.zero_copy, gpu_memory=a.gpu_memory, max_batch=getattr(a, "max_batch", 1))


def save_expert_profile(llm: LLM, a) -> None:
    """--save-expert-profile: the streamed run's routing counts, written whole or not at all."""
    if getattr(a, "save_expert_profile", None):
        if getattr(llm.model, "expert_store", None) is None:
            raise KilnError("--save-expert-profile: the experts loaded resident (--gpu-memory holds them all), "
                            "so no routing was recorded")
        data = json.dumps(llm.model.expert_store.profile(), indent=1).encode() + b"\n"
        write_atomic(a.save_expert_profile, lambda f: f.write(data))


def load_announced(a, check=None) -> LLM:
    """load_from_flags, then one line on stderr saying what loaded (unless --quiet)."""
    llm = load_from_flags(a, check)
    if not a.quiet:
        print(f"kiln: loaded {llm.path.name} ({type(llm.model).__name__}, {llm.engine.dtype}, "
              f"{llm.engine.device}) in {llm.load_s:.2f} s", file=sys.stderr)
    return llm
