"""What the INT4 and NVFP4 checkpoint writers share: which tensors they quantize, and the dtype
the releases keep everything else in.

Both formats' releases (Kimi-K2-Thinking / Kimi-K2.5 INT4, ModelOpt NVFP4) quantize the routed
experts' projections, stored one tensor per expert and projection, and keep the rest in bfloat16
but for the routers' float32 correction biases. Some releases quantize every linear layer but
the routers and the LM head (attention, shared experts and dense MLPs too): `all_linears`.
"""

from __future__ import annotations

import re

import torch

ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
"""A routed expert projection's weight, as DeepSeek-V3 and Qwen3-MoE checkpoints name them."""
KEPT_FP32 = ("e_score_correction_bias",)
NEVER_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")
"""2-D weights no release quantizes: embeddings, the LM head, the routers, Qwen2-MoE's shared gate."""


def is_routed_expert(name: str) -> bool:
    return ROUTED_EXPERT.fullmatch(name) is not None


def is_quantized(name: str, tensor: torch.Tensor, all_linears: bool) -> bool:
    """Whether the writer quantizes tensor `name`: a routed expert projection, or with
    `all_linears` any linear layer's weight but those in NEVER_QUANTIZED."""
    if all_linears:
        return tensor.dim() == 2 and name.endswith(".weight") and not name.endswith(NEVER_QUANTIZED)
    return is_routed_expert(name)


def unquantized(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor the release keeps unquantized, in the dtype it keeps it in."""
    if tensor.is_floating_point() and not name.endswith(KEPT_FP32):
        return tensor.to(torch.bfloat16)
    return tensor


def linear_modules(names: list[str]) -> list[str]:
    """The module of every 2-D-weight-bearing layer among tensor `names` but the embeddings."""
    return sorted({n.removesuffix(".weight") for n in names if n.endswith(".weight") and "embed_tokens" not in n})
