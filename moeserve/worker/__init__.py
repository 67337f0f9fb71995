"""What runs the model on one rank: the model runner, its persistent batch, the sampler and the paged KV cache."""

from moeserve.worker.input_batch import InputBatch
from moeserve.worker.kv_cache import allocate_kv_caches, bytes_per_block, num_blocks_for
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import ModelRunner, SampledToken
from moeserve.worker.sampler import Sampler

__all__ = [
    "InputBatch",
    "ModelRunner",
    "PromptLogprobs",
    "SampledToken",
    "Sampler",
    "allocate_kv_caches",
    "bytes_per_block",
    "num_blocks_for",
]
