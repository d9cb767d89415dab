"""The decode step captured as one CUDA graph.

A graph replays fixed kernels on fixed addresses, so it is captured over one persistent per-layer
state (the engine resets it between requests instead of allocating a new one) and over static
token/position inputs. A KV buffer that grows (a longer request: a new context bucket) changes the
addresses, and the graph is captured again. The first decode step of a bucket runs eagerly (it
compiles kernels and allocates workspaces), the next one is captured and then replayed every token.

Python bookkeeping inside the forward (each layer's `.length`) runs once during capture; the runner
restores it and advances it by one after each replay.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from .cache import GDNState, KVCache

GRAPHABLE = (KVCache, GDNState)


def graphable(state: list) -> bool:
    return all(isinstance(layer, GRAPHABLE) for layer in state)


def signature(state: list) -> tuple:
    """The buffer addresses a graph captured over this state depends on."""
    out = []
    for layer in state:
        if isinstance(layer, KVCache):
            out += [layer.k.data_ptr(), layer.v.data_ptr()]
        else:
            out += [layer.conv.data_ptr(), layer.ssm.data_ptr()]
    return tuple(out)


class DecodeGraph:
    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.ids = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.key: tuple | None = None
        self.warm: tuple | None = None    # the signature an eager step has run on
        self.launches: int | None = None
        self.captures = 0
        self.failed = False               # a capture failed: decode eagerly

    def step(self, token: int, pos: int, state: list, quiet: bool = True) -> torch.Tensor:
        self.ids.fill_(token)
        self.pos.fill_(pos)
        key = signature(state)
        if self.failed:
            return self.model.forward(self.ids, self.pos, state)[-1]
        if self.key != key:
            if self.warm != key:           # first step on these buffers: eager (compiles, allocates)
                self.warm = key
                return self.model.forward(self.ids, self.pos, state)[-1]
            if not self._try_capture(state, key, quiet):
                return self.model.forward(self.ids, self.pos, state)[-1]
        self.graph.replay()
        for layer in state:
            layer.length += 1
        return self.logits[-1]

    def _try_capture(self, state: list, key: tuple, quiet: bool) -> bool:
        """Capture, or on failure (an op that is not graph-safe) warn once and decode eagerly from now on."""
        lengths = [layer.length for layer in state]
        try:
            self._capture(state, key, quiet)
            return True
        except Exception as e:        # noqa: BLE001 - any capture error means: run eagerly
            for layer, n in zip(state, lengths):
                layer.length = n
            self.failed, self.graph, self.logits, self.key = True, None, None, None
            torch.cuda.synchronize(self.device)
            print(f"[kiln] warning: the decode step could not be captured as a CUDA graph "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); decoding eagerly", file=sys.stderr)
            return False

    def _capture(self, state: list, key: tuple, quiet: bool) -> None:
        self.graph = self.logits = None
        lengths = [layer.length for layer in state]
        torch.cuda.synchronize(self.device)
        try:                 # keep_graph: the node list stays readable until instantiate()
            graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:
            graph, kept = torch.cuda.CUDAGraph(), False
        with torch.cuda.graph(graph):
            logits = self.model.forward(self.ids, self.pos, state)
        for layer, n in zip(state, lengths):
            layer.length = n
        self.launches = count_nodes(graph) if kept else None
        if kept:
            graph.instantiate()
        self.graph, self.logits, self.key = graph, logits, key
        self.captures += 1
        if not quiet:
            cap = max((layer.capacity for layer in state if isinstance(layer, KVCache)), default=0)
            n = "?" if self.launches is None else self.launches
            print(f"[kiln] decode step captured as one CUDA graph: {n} launches per token "
                  f"(context bucket {cap})", file=sys.stderr)


def count_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Kernel, copy and memset nodes of a captured graph (the driver's cuGraphGetNodes), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        if lib.cuGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    except Exception:                   # no driver library, a torch without the accessor
        return None
