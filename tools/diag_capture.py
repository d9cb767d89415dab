"""Why a model's CUDA graph capture fails: the load's tuner timings that could not be captured (each
op and the error), a trivial capture tried right after the load (is the context already broken?),
then the model's prefill and decode forwards run inside their captures, an exception raised there printed whole.

    PYTHONPATH=. python3 tools/diag_capture.py MODEL [--no-tune]

--no-tune loads with KILN_TUNE_BUDGET_S=0 (defaults, no timing) to tell the tuner's part apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--no-tune", action="store_true")
    a = ap.parse_args()
    if a.no_tune:
        os.environ["KILN_TUNE_BUDGET_S"] = "0"
    import kiln
    from kiln.backends import graphs
    from kiln.tune import timing

    graph_ms = timing._graph_ms

    def logged(runs, device, reps):
        try:
            return graph_ms(runs, device, reps)
        except RuntimeError as e:
            print(f"[diag] tuner timing not capturable: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            traceback.print_stack(limit=8, file=sys.stderr)
            raise

    timing._graph_ms = logged
    llm = kiln.load(a.model, device="cuda", dtype="bf16", quiet=False)
    x = torch.zeros(4, device="cuda")
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        print("[diag] a trivial capture after the load: fine", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        print(f"[diag] a trivial capture after the load FAILS: {type(e).__name__}: {e}", file=sys.stderr)
    for cls, name in ((graphs.DecodeGraph, "_body"), (graphs.PrefillGraphs, "_body")):
        orig = getattr(cls, name)

        def wrapped(self, *args, _orig=orig, _cls=cls, **kw):
            try:
                return _orig(self, *args, **kw)
            except Exception:
                if torch.cuda.is_current_stream_capturing():
                    print(f"[diag] inside a capture ({_cls.__name__}):", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                raise
        setattr(cls, name, wrapped)
    out = llm.generate([(7 * i + 3) % 300 for i in range(24)], max_new_tokens=10, temperature=0)
    print("[diag] tokens", out.token_ids, file=sys.stderr)


if __name__ == "__main__":
    main()
