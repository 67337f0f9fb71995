"""Engine: model runner, sampler, paged KV cache allocation and the request loop."""

from moeserve.engine.engine import LLMEngine
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionOutput", "LLMEngine", "Logprob", "RequestOutput"]
