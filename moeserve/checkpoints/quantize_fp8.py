"""Rewrite a checkpoint folder as FP8 block-quantized, in the layout DeepSeek-V3 and Qwen3-FP8
are published in.

Every linear weight (a 2-D `*.weight` of a projection, shared or routed expert) becomes
float8_e4m3fn with `*.weight_scale_inv` of one scale per block (`fp8_format.py`), float32 as
DeepSeek stores them unless asked for Qwen3-FP8's bfloat16 or float16;
the embeddings, the LM head, the norms, the routers' gates and DeepSeek-V3.2's indexer head
weights stay as they were, as in the published checkpoints. config.json gets the published `quantization_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moeserve.checkpoints.rewrite import rewrite_tensors
from moeserve.fp8_format import SCALE_DTYPE, quantize, scale_name

# Module names left unquantized; DeepSeek-V3.2's indexer keeps its head weights (`weights_proj`)
# unquantized, its wq_b and wk are FP8.
_KEPT = ("embed_tokens", "lm_head", "gate", "router", "shared_expert_gate", "weights_proj")


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the published FP8 checkpoints quantize this tensor."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    return name.removesuffix(".weight").rsplit(".", 1)[-1] not in _KEPT


def quantize_checkpoint(
    folder: str | Path, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = SCALE_DTYPE
) -> None:
    """Quantize `folder`'s safetensors in place (each file keeps its tensors and gains their
    scales, in `scale_dtype`; the index, if any, lists them) and declare it in config.json."""
    folder = Path(folder)

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized(name, tensor):
            return {name: tensor}
        weight, scale_inv = quantize(tensor, block, scale_dtype)
        return {name: weight, scale_name(name): scale_inv}

    rewrite_tensors(folder, rewrite)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
