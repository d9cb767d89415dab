"""Launch options some kernels need (kept out of common.py, whose edits re-tune every op)."""

# The kernels that round a product to 16 bits and then add it, as the reference does: by default
# Triton narrows both steps to 16-bit ops and contracts them into one FMA, which skips that rounding
# (bench/cross_compile.py fails on any 16-bit FMA; docs/compiler.md). f32 FMAs elsewhere stay: they
# skip no rounding the reference does.
EXACT_ROUNDING = {"enable_fp_fusion": False}
