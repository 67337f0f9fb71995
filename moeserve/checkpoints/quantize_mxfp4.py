"""Rewrite a gpt-oss checkpoint folder with MXFP4 experts, in the layout gpt-oss-20b/120b are
published in and transformers reads.

transformers' bf16 form stores a layer's experts as `mlp.experts.gate_up_proj` `[E, H, 2I]`
(gate and up columns interleaved) and `down_proj` `[E, I, H]`, inputs first. The published form
stores each projection outputs first, cut into 32-value blocks along its input
(`mxfp4_format.py`): `gate_up_proj_blocks` `[E, 2I, H/32, 16]` with `gate_up_proj_scales`
`[E, 2I, H/32]` (rows still interleaved), `down_proj_blocks` `[E, H, I/32, 16]` with
`down_proj_scales` `[E, H, I/32]`. The expert biases are bf16; every other tensor is left as it
was, and config.json gets the published `quantization_config`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeserve.checkpoints.rewrite import rewrite_checkpoint
from moeserve.mxfp4_format import quantize

_PROJECTIONS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_BIASES = ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")
# gpt-oss-20b's and -120b's config.json: everything but the experts stays unquantized.
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if name.endswith(_PROJECTIONS):
        blocks, scales = quantize(tensor.transpose(-1, -2))  # [E, in, out] -> outputs first
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}
    if name.endswith(_BIASES):
        return {name: tensor.to(torch.bfloat16)}
    return {name: tensor}


def quantize_checkpoint(folder: str | Path) -> None:
    """Quantize `folder`'s gpt-oss experts in place (each file keeps its other tensors; the
    index, if any, lists the new names) and declare it in config.json."""
    quant = {"modules_to_not_convert": MODULES_NOT_CONVERTED, "quant_method": "mxfp4"}
    rewrite_checkpoint(Path(folder), "GptOssForCausalLM", "MXFP4", _rewrite, {"quantization_config": quant})
