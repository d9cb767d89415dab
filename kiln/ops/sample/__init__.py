"""The greedy choice made on the device, inside the decode step's CUDA graph."""
