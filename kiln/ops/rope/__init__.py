"""RoPE: the cos/sin tables and the rotation; the kernel that norms, rotates and appends q/k to the cache."""
