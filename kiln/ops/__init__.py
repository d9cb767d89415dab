"""The op families: one package per family (norm, gemm, attention, rope, gdn, moe, sample), each with

- reference.py: the plain PyTorch ops, rounding where the HF reference rounds (the specification;
  no Triton import, so the reference backend runs where Triton does not);
- kernels.py (and siblings): the Triton kernels, their variants and their tuner op (kiln.tune.registry);
- cuda.py: the dispatch that runs the tuned kernel, or the reference where a call does not fit.

kiln.backends composes the families: ReferenceOps from the references, CudaOps from the dispatches.
"""
