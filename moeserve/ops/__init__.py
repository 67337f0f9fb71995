"""Layer operations: the `LayerOps` interface layers compute through, its backends (`torch`,
the reference and CPU path; `triton`, the GPU kernels) and the step's `AttentionBatch`, which
each backend turns into its own attention plan."""

from moeserve.ops.attention import AttentionBatch, AttentionPlan, attention_batch
from moeserve.ops.base import LayerOps
from moeserve.ops.registry import OPS_BACKENDS, TRITON_VERIFIED_ON_GPU, create_ops
from moeserve.ops.torch_ops import TORCH_OPS, TorchOps

__all__ = [
    "OPS_BACKENDS",
    "TORCH_OPS",
    "TRITON_VERIFIED_ON_GPU",
    "AttentionBatch",
    "AttentionPlan",
    "LayerOps",
    "TorchOps",
    "attention_batch",
    "create_ops",
]
