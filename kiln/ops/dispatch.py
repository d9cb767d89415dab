"""What each family's cuda dispatch (kiln/ops/<family>/cuda.py) needs from the backend that composes
them: the device, the tuner's plan, and the families switched off."""

from __future__ import annotations

import os

import torch

from ..tune.device import DeviceInfo, interpreting


def families_off() -> frozenset[str]:
    """KILN_KERNELS_OFF=attention,gdn,...: those families run their reference ops (A/B runs, bisecting)."""
    return frozenset(f.strip() for f in os.environ.get("KILN_KERNELS_OFF", "").split(",") if f.strip())


class TunedOps:
    plan = None                         # kiln.tune.tuner.Plan; until the backend tunes, each op's default
    dev: DeviceInfo
    off: frozenset[str] = frozenset()   # families that run their reference ops

    def runs_here(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda" or interpreting()

    def on(self, family: str, x: torch.Tensor) -> bool:
        """Whether `family`'s kernels may run on x (on this device, not switched off)."""
        return family not in self.off and self.runs_here(x)

    def choose(self, op, shape):
        """The tuned variant for this shape (the nearest tuned row bucket), or the op's default."""
        return self.plan.choose(op, shape) if self.plan is not None else op.default(shape, self.dev)
