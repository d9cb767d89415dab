"""MLX affine quantisation: quantize / dequantize exactly as mlx does (the format kiln keeps quantised weights in)."""
