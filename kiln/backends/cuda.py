"""The cuda backend: the Triton kernels of kiln.ops, compiled for the loaded model's shapes and chosen
by the tuner (kiln.tune), each family's dispatch falling back to its reference where a call does not
fit (a bias, mixed dtypes, a ring cache). Every decode-path op is CUDA-graph safe: no host reads,
state updated in place, so the engine can capture the decode step (graphs.py).

On CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1): slow, for tests.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from ..errors import KilnError
from ..ops import nvrtc, plain
from ..ops.attention.cuda import AttentionCuda
from ..ops.dispatch import families_off
from ..ops.fork import ForkOps
from ..ops.gdn.cuda import GdnCuda
from ..ops.gemm.cuda import GemmCuda
from ..ops.moe.cuda import MoeCuda
from ..ops.norm.cuda import NormCuda
from ..ops.quant.cuda import dense_decode_workloads, quant_workloads
from ..ops.rope.cuda import RopeCuda
from ..ops.sample.cuda import SampleCuda
from ..tune.device import device_info, interpreting
from ..tune.registry import REGISTRY
from ..tune.tuner import Tuner, Workload
from .reference import ReferenceOps

PREFILL_CHUNK = 512               # the engine's chunk on the reference backend: tuned as well
DECODE_ROWS = 1
DECODE_CONTEXTS = (2048, 32768)   # decode attention is measured at these context lengths
# the routed experts also at the prefill graphs' larger buckets (kiln.backends.graphs): their best tile
# at 1,024 rows is not the 4,096-row chunk's (bench/NOTES.md, 2026-12-03: 0.366 against 0.379 ms)
MOE_ROWS = (1024, 2048)
# what a batched decode step runs at B rows (attention and the GDN step run per request's row)
BATCH_OPS = ("gemm", "gemm_act", "rmsnorm", "residual_norms", "qk_rope", "moe")
OPS = ("gemm", "rmsnorm", "residual_norms", "rmsnorm_gemm", "gdn_prefill", "gdn_decode", "moe", "attention",
       "attention_decode", "qk_rope", "gemm_act", "act_gemm", "qgemv")


class CudaOps(ForkOps, NormCuda, GemmCuda, AttentionCuda, GdnCuda, MoeCuda, SampleCuda, RopeCuda, ReferenceOps):
    name = "cuda"
    batch_invariant = False  # its kernels are tuned per row count: a batch may run other ones (docs/batching.md)
    pooled = True    # batched decode reads each request's state from a slot pool (kiln.cache.SlotPool)
    graphs = True    # its decode path may be captured as one CUDA graph (kiln/backends/graphs.py)
    # Prompt chunk: long enough that attention and the GDN scan fill the GPU (512-token chunks
    # leave most SMs idle in attention), short enough that activations stay small.
    prefill_chunk = 4096     # under the interpreter (CPU tests): 512

    def __init__(self, device: torch.device | str = "cuda"):
        super().__init__(device)
        if self.device.type != "cuda" and not interpreting():
            raise KilnError("backend cuda needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels on CPU, slowly)")
        self.dev = device_info(self.device)
        self.off = families_off()
        if self.device.type != "cuda":
            self.prefill_chunk = 512
        self.tune_s: float | None = None
        self.tune_cache: str | None = None
        self._tuner: Tuner | None = None     # precompile's tuner, taken by prepare
        self._warm = None                    # precompile's thread compiling the plain kernels

    def precompile(self, model_class, cfg, dtype: torch.dtype, *, retune: bool = False, pins=None,
                   budget_s: float | None = None, quiet: bool = True, max_batch: int = 1) -> None:
        """Before the weights load: start compiling, in worker processes, the kernels prepare() will
        need for this config's shapes (nothing on a warm start), so a cold start compiles while the
        weights are read. prepare() takes the same arguments and waits for them."""
        if self.device.type != "cuda":      # no worker processes under the interpreter
            return
        self._tuner = Tuner(self.device, dtype, retune=retune, pins=pins, budget_s=budget_s, quiet=quiet)
        self._tuner.precompile(self.dense_workloads(model_class, cfg, max_batch))
        if os.environ.get("KILN_WARM_PLAIN", "1") != "0":     # 0: no warm-up thread (diagnosis)
            self._warm = plain.warm(cfg, dtype, self.device, log=lambda line: print(line, file=sys.stderr, flush=True))

    def join_warm(self) -> None:
        """Wait for precompile's plain warm-up (usually done: it started before the weights). Before the
        tuner times anything: the warm-up's router and greedy launches count arrivals in the per-device
        buffers (gemm.arrival_counters, the greedy workspace) that the tuner's split-K candidates use on
        its timing stream, and two kernels at once on one counter leave it off for good (every later
        launch then reads a partial sum)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.join()

    def drop_precompile(self) -> None:
        """The load failed before prepare(): stop precompile's workers (queued jobs cancelled)."""
        tuner, self._tuner = self._tuner, None
        if tuner is not None:
            tuner.cancel()

    def dense_workloads(self, model_class, cfg, max_batch: int = 1, m_values=None) -> list[Workload]:
        """Every (op, shape) the config gives (all but the quantised weights' formats, which the
        weights give): prefill chunks, one-row decode, and the batched decode buckets."""
        return load_workloads(model_class, cfg, self.prefill_chunk, self.off, max_batch, m_values)

    def prepare(self, model, dtype: torch.dtype, *, m_values=None, retune: bool = False, pins=None,
                budget_s: float | None = None, quiet: bool = True, max_batch: int = 1):
        """Compile and tune the kernels for `model`'s shapes (a cache hit measures nothing); with
        `max_batch` > 1 the projections also at the batched decode steps' row buckets (batch_buckets)."""
        t0 = time.perf_counter()
        tuner, self._tuner = self._tuner, None     # precompile's, its jobs under way
        if tuner is None or tuner.dtype != dtype:
            tuner = Tuner(self.device, dtype, retune=retune, pins=pins, budget_s=budget_s, quiet=quiet)
        base = self.dense_workloads(type(model), model.cfg, max_batch, m_values)
        act = getattr(model.cfg, "hidden_act", None) or getattr(model.cfg, "hidden_activation", None)
        after = (model.cfg.hidden_size, model.norm_style) if getattr(model, "projections_later", False) else None
        extra = [Workload(op, s) for op, s in quant_workloads(model.w, base, act, nvrtc.kernels_run(device_info(
            self.device)), after) if op.family not in self.off]
        if extra:
            base = dense_decode_workloads(model.w, base)
        self.join_warm()
        self.plan, report = tuner.tune(base + extra)
        self.tune_s, self.tune_cache = time.perf_counter() - t0, "hit" if report.hit else "miss"
        return report


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Row counts the projections are tuned at for batched decode: powers of 4 below max_batch and
    max_batch itself (a step of B rows runs the first bucket >= B: kiln.tune.tuner.Plan.choose)."""
    if max_batch <= 1:
        return ()
    out, b = [], 4
    while b < max_batch:
        out.append(b)
        b *= 4
    return (*out, max_batch)


def load_workloads(model_class, cfg, chunk: int = CudaOps.prefill_chunk, off=frozenset(), max_batch: int = 1,
                   m_values=None) -> list[Workload]:
    """What a load tunes (CudaOps.dense_workloads) with the engine's prefill `chunk` (a GPU's by default):
    both prefill chunks, the routed experts' larger graph buckets, one-row decode, and with max_batch
    the batched decode's buckets; or the rows `m_values` and the buckets."""
    default = not m_values
    m_values = m_values or tuple(dict.fromkeys((PREFILL_CHUNK, chunk, DECODE_ROWS)))
    base = workloads(model_class, cfg, m_values, off=off)
    if default:
        top = max(m_values)
        base += [Workload(w.op, w.op.with_rows(w.shape, r)) for w in base if w.op.name == "moe"
                 and w.shape.rows == top for r in MOE_ROWS if PREFILL_CHUNK < r < top]
    buckets = tuple(b for b in batch_buckets(max_batch) if b not in m_values)
    if buckets:    # and the projections that run on one row only alone (the LM head) at every bucket
        heads = [Workload(w.op, w.op.with_rows(w.shape, b)) for w in base if w.op.name == "gemm"
                 and w.shape.rows == 1 for b in buckets]
        base = list(dict.fromkeys(base + workloads(model_class, cfg, buckets, ops=BATCH_OPS, off=off) + heads))
    return base


def workloads(model_class, cfg, m_values=(PREFILL_CHUNK, DECODE_ROWS), ops=OPS, off=frozenset()) -> list[Workload]:
    """The (op, shape) pairs to tune: the shapes the model declares its kernels run
    (Model.kernel_shapes), less the ops not asked for, the families switched off and the shapes an
    op's kernels do not take."""
    contexts = (64,) if interpreting() else DECODE_CONTEXTS     # the interpreter is slow
    out = []
    for ks in model_class.kernel_shapes(cfg, tuple(m_values), contexts):
        op = REGISTRY.get(ks.op)
        if op is None or ks.op not in ops or op.family in off:
            continue
        shape = op.shape_type(**dict(ks.dims))
        if op.accepts(shape):
            out.append(Workload(op, shape))
    return list(dict.fromkeys(out))
