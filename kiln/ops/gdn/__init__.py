"""Gated DeltaNet: the causal conv, the delta rule (chunked prefill, one-kernel decode step), the gated norm."""
