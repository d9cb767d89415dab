"""Projections: the GEMM and GEMV, the gated MLP (gate|up with its activation), the norm run inside the
next GEMV, and (reference only) the embedding and the LM head."""
