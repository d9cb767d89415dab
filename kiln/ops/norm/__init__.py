"""RMSNorm in its three roundings (llama, offset, plain), alone and with the residual add before it."""
