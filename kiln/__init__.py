"""kiln: an LLM inference engine that compiles its kernels for the model it loads."""

__version__ = "0.1.0"

from .api import LLM, Completion, Generation, Stats, load  # noqa: E402
from .errors import KilnError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["load", "LLM", "Completion", "Generation", "SamplingParams", "Stats", "KilnError", "__version__"]
