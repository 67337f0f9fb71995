"""Rewrite a checkpoint folder as FP8 block-quantized, in the layout DeepSeek-V3, Qwen3-FP8 and
Qwen's hybrid FP8 releases (Qwen3-Next, Qwen3.5-MoE) are published in.

Every linear weight (a 2-D `*.weight` of a projection, shared or routed expert) becomes
float8_e4m3fn with `*.weight_scale_inv` of one scale per block (`fp8_format.py`), float32 as
DeepSeek stores them unless asked for Qwen's bfloat16 or float16;
the embeddings, the LM head, the norms, the routers' gates and DeepSeek-V3.2's indexer head
weights stay as they were, as in the published checkpoints. The hybrids' releases also keep the
Gated DeltaNet's conv1d (not a 2-D weight), `A_log`, `dt_bias` and its b/a projections
(`in_proj_ba`, or Qwen3.5's `in_proj_b`/`in_proj_a`: one row per value head, too narrow for a
scale block) unquantized, list every module they keep in `modules_to_not_convert`, and, where
Qwen3.5's experts are stacked (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`),
quantize each expert's gate and up halves as the per-expert tensors they were stacked from
(`experts.gate_up_proj_scale_inv [E, 2 * ceil(I / bo), ceil(H / bi)]`). config.json gets the
published `quantization_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moeserve.checkpoints.rewrite import rewrite_tensors
from moeserve.fp8_format import SCALE_DTYPE, quantize, scale_name

# Module names left unquantized; DeepSeek-V3.2's indexer keeps its head weights (`weights_proj`)
# unquantized, its wq_b and wk are FP8; the hybrids keep their DeltaNets' b/a projections.
_KEPT = (
    "embed_tokens",
    "lm_head",
    "gate",
    "router",
    "shared_expert_gate",
    "weights_proj",
    "in_proj_ba",
    "in_proj_b",
    "in_proj_a",
)
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
"""Whose FP8 releases list `modules_to_not_convert` (DeepSeek-V3's and Qwen3's list none)."""
_STACKED_PARTS = {"experts.gate_up_proj": 2, "experts.down_proj": 1}
"""Qwen3.5's stacked expert tensors `[E, out, in]` -> the projections their rows stack."""


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the published FP8 checkpoints quantize this tensor (a stacked expert tensor aside)."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    return name.removesuffix(".weight").rsplit(".", 1)[-1] not in _KEPT


def quantize_stacked(
    tensor: torch.Tensor, parts: int, block: tuple[int, int], scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, parts * rows, in]` -> (FP8 of that shape, scales `[E, parts * grid_rows, grid_cols]`):
    each expert's parts quantized on their own, their scale grids stacked along the rows."""
    quantized = [quantize(part, block, scale_dtype) for expert in tensor for part in expert.chunk(parts)]
    weights = [torch.cat([w for w, _ in quantized[e : e + parts]]) for e in range(0, len(quantized), parts)]
    scales = [torch.cat([s for _, s in quantized[e : e + parts]]) for e in range(0, len(quantized), parts)]
    return torch.stack(weights), torch.stack(scales)


def quantize_checkpoint(
    folder: str | Path, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = SCALE_DTYPE
) -> None:
    """Quantize `folder`'s safetensors in place (each file keeps its tensors and gains their
    scales, in `scale_dtype`; the index, if any, lists them) and declare it in config.json."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    hybrid = (config.get("architectures") or [""])[0] in HYBRID_ARCHITECTURES
    kept: list[str] = []

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        stacked = next((p for suffix, p in _STACKED_PARTS.items() if name.endswith(suffix)), 0)
        if hybrid and stacked and tensor.dim() == 3:
            weight, scale_inv = quantize_stacked(tensor, stacked, block, scale_dtype)
            return {name: weight, scale_name(name): scale_inv}
        if not is_quantized(name, tensor):
            if name.endswith(".weight") and tensor.dim() >= 2:
                kept.append(name.removesuffix(".weight"))
            return {name: tensor}
        weight, scale_inv = quantize(tensor, block, scale_dtype)
        return {name: weight, scale_name(name): scale_inv}

    rewrite_tensors(folder, rewrite)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if hybrid:
        config["quantization_config"]["modules_to_not_convert"] = sorted(kept)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
