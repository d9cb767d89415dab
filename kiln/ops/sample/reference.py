"""Greedy choice, the reference: the graph step's argmax written into its own inputs, as the kernel does."""

from __future__ import annotations

import torch


class SampleReference:
    def greedy_next(self, logits: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> None:
        """The decode graph's greedy choice: ids <- argmax(logits), pos += 1 (the step's own inputs)."""
        greedy_next_reference(logits, ids, pos)


def greedy_next_reference(logits: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> None:
    """ids <- argmax(logits), a NaN counting as +inf (as greedy_kernel); pos += 1."""
    x = logits.float()
    x = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)
    ids.fill_(int(torch.argmax(x)))
    pos.add_(1)
