"""MoE model runtime: layers, architectures and the Hugging Face checkpoint loader."""

from moeserve.models.architectures import resolve_architecture, supported_architectures
from moeserve.models.checkpoint import CheckpointError
from moeserve.models.decoder import MoECausalLM, kv_cache_shape
from moeserve.models.loader import load_model, model_config
from moeserve.models.tensor_parallel import TensorParallel

__all__ = [
    "CheckpointError",
    "MoECausalLM",
    "TensorParallel",
    "kv_cache_shape",
    "load_model",
    "model_config",
    "resolve_architecture",
    "supported_architectures",
]
