"""The decode step captured as one CUDA graph.

A graph replays fixed kernels on fixed addresses, so it is captured over one persistent per-layer
state (the engine resets it between requests instead of allocating a new one) and over static
token/position inputs. A KV buffer that grows (a longer request: a new context bucket) changes the
addresses, and the graph is captured again. The first decode step of a bucket runs eagerly (it
compiles kernels and allocates workspaces), the next one is captured and then replayed every token.

Python bookkeeping inside the forward (each layer's `.length`) runs once during capture; the runner
restores it and advances it by one after each replay.

The step ends with the greedy choice (ops.greedy_next, kiln/ops/sample): argmax into the step's own token
input, position + 1. Greedy requests then feed the graph from the device and the host queues the
next step before reading a token (greedy_tokens); other requests fill both inputs from the host.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from ..cache import GDNState, KVCache

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
        """The logits of one decode step fed `token` at `pos` (the host's inputs)."""
        self.ids.fill_(token)
        self.pos.fill_(pos)
        return self.run(state, quiet)

    def run(self, state: list, quiet: bool = True) -> torch.Tensor:
        """One decode step on the graph's own ids/pos: the host's (step) or the last step's greedy
        choice (the pipelined greedy loop). Asynchronous: nothing is read back."""
        key = signature(state)
        if self.failed:
            return self._body(state)[-1]
        if self.key != key:
            if self.warm != key:           # first step on these buffers: eager (compiles, allocates)
                self.warm = key
                return self._body(state)[-1]
            if not self._try_capture(state, key, quiet):
                return self._body(state)[-1]
        self.graph.replay()
        for layer in state:
            layer.length += 1
        return self.logits[-1]

    def _body(self, state: list) -> torch.Tensor:
        """The forward, then the greedy choice written into ids (and pos + 1) for the next step."""
        logits = self.model.forward(self.ids, self.pos, state)
        self.model.ops.greedy_next(logits[-1], self.ids, self.pos)
        return logits

    def greedy_tokens(self, token: int, pos: int, state: list, steps: int, fed: list, before=None,
                      quiet: bool = True):
        """The tokens of `steps` greedy decode steps after `token` fed at `pos`, chosen on the device;
        while the host reads one, the next step is already queued, so the GPU never waits for Python.
        A consumer that stops early leaves up to two more steps run: `fed` gets every token the state
        was fed, in order (completed when the generator closes). `before(k)` runs before step k."""
        cuda = self.device.type == "cuda"
        host = torch.empty(4, dtype=torch.long, pin_memory=cuda)
        events = [torch.cuda.Event() if cuda else None for _ in range(4)]
        self.ids.fill_(token)
        self.pos.fill_(pos)
        launched, read, known = 0, 0, [token]

        def launch() -> None:
            nonlocal launched
            if before is not None:
                before(launched)
            self.run(state, quiet)
            host[launched % 4 : launched % 4 + 1].copy_(self.ids, non_blocking=True)   # the token it chose
            if cuda:
                events[launched % 4].record()
            launched += 1

        def collect() -> int:
            nonlocal read
            if cuda:
                events[read % 4].synchronize()
            read += 1
            known.append(int(host[(read - 1) % 4]))
            return known[-1]

        try:
            while launched < min(2, steps):
                launch()
            while read < steps:
                tok = collect()
                if launched < steps:
                    launch()
                yield tok
        finally:
            while read < launched - 1:       # the steps run past the consumer: their fed tokens
                collect()
            fed.extend(known[:launched])

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
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[kiln] warning: the decode step could not be captured as a CUDA graph ({why}); decoding eagerly",
                  file=sys.stderr)
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
            logits = self._body(state)
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
