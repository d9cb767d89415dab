"""llama.cpp as `kiln bench --baseline llama.cpp`, through llama-cpp-python (an optional install).

It runs inside bench's worker process, like the transformers baseline: the parent sends the token ids
kiln gets, and llama.cpp evaluates those ids (no tokenizer, no BOS added) from the same GGUF file,
with kiln's thread count, greedy. Its timings bracket the same phases as kiln's: prefill from the ids
going in to the first token's argmax, decode from there to the last token.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from ..errors import KilnError

NAME = "llama.cpp"
PREFILL_BATCH = 512   # tokens per llama.cpp decode call: the prefill chunk kiln's engine uses


def check_installed() -> None:
    """Fail before a long run, not after it, when the library is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise KilnError("--baseline llama.cpp needs llama-cpp-python (pip install 'kiln[llamacpp]')")


def check_gguf(spec: str | None, path) -> None:
    """llama.cpp reads GGUF files only, and must read the very file kiln loads."""
    p = Path(path) if path is not None else None
    if (spec or "").startswith("synth:") or p is None or not p.is_file() or _magic(p) != b"GGUF":
        raise KilnError(f"--baseline llama.cpp needs a GGUF model file; {spec or path} is not one")


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


def load(cfg: dict):
    """(ready facts, measure function) for the worker; raises what llama.cpp raises when it cannot load."""
    import llama_cpp

    gpu = cfg["device"].startswith("cuda")
    if gpu and not llama_cpp.llama_supports_gpu_offload():
        raise KilnError("this llama-cpp-python build cannot offload to a GPU: bench it with --device cpu")
    n = cfg["n_threads"]
    llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=PREFILL_BATCH, n_threads=n,
                          n_threads_batch=n, n_gpu_layers=-1 if gpu else 0, logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def measure(req: dict) -> dict:
        return run(llama_cpp, llm, vocab, req["ids"], req["gen"])

    return {"version": llama_cpp.__version__, "n_threads": n}, measure


def _next_token(lib, llm, vocab: int) -> int:
    # logits_all=False keeps only the last position's logits, in llama.cpp's buffer: read them there
    return int(np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())


def run(lib, llm, vocab: int, ids: list[int], gen: int) -> dict:
    """One prefill of `ids` and `gen` greedy tokens, timed as kiln's KilnRunner times itself."""
    llm.reset()   # the next eval drops every cached position past 0
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = _next_token(lib, llm, vocab)
    t1 = time.perf_counter()
    tokens = [tok]
    for _ in range(gen - 1):
        llm.eval([tok])
        tok = _next_token(lib, llm, vocab)
        tokens.append(tok)
    return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": tokens}
