"""Mixture of experts: routers, the routed experts (grouped GEMM or GEMV), their combine with Qwen's sigmoid-
gated shared expert."""
