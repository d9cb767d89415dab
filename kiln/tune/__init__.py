"""The autotuner: kernel registry (registry), correctness gate (gate), timing, cache, the tuner that
ties them together (tuner), a model's workloads (workloads), and `kiln tune` / `kiln kernels`."""
