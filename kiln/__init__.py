"""kiln: an LLM inference engine that compiles its kernels for the model it loads."""

__version__ = "0.1.0"
