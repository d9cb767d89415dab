"""Causal GQA attention over the KV cache: flash prefill and split-KV decode, q/k norm + RoPE + the KV
append in one kernel in front (kiln.ops.rope)."""
