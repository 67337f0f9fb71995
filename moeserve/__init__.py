"""moeserve: an inference server for Mixture-of-Experts LLMs with expert parallelism.

Nothing is imported eagerly beyond the light public names: `import moeserve` does no work.
"""

from moeserve.engine.outputs import CompletionOutput, RequestOutput
from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
