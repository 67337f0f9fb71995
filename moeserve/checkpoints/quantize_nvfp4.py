"""Rewrite a DeepSeek-V3 or Qwen3-MoE checkpoint folder with NVFP4 routed experts, in the layout
NVIDIA's ModelOpt releases use (DeepSeek-R1-FP4, Qwen3-FP4).

Each routed expert projection (with `all_linears`, each linear layer) `<m>.weight` becomes the
uint8 codes under the same name with `<m>.weight_scale` (float8_e4m3fn, one per 16 inputs), `<m>.weight_scale_2` and
`<m>.input_scale` (float32 scalars) (`nvfp4_format.py`); the rest is kept in bfloat16
(`packed_experts.py`). The quantization is stated in `hf_quant_config.json`, as ModelOpt
exports it, with shell-style `exclude_modules` wildcards for what stays unquantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moeserve.checkpoints.packed_experts import is_quantized, unquantized
from moeserve.checkpoints.rewrite import rewrite_tensors
from moeserve.nvfp4_format import GROUP, SCALE_MAX, quantize

EXCLUDED = ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_expert*"]
"""What stays unquantized: the LM head, attention and the routers, as the releases exclude them,
and the shared experts (DeepSeek's `shared_experts`, Qwen2-MoE's `shared_expert` and its gate),
as the releases that quantize the routed experts only do."""
DENSE_LAYERS = "model.layers.{}.mlp*"  # DeepSeek's first dense layers, excluded by index
EXCLUDED_ALL_LINEARS = ["lm_head", "model.layers.*.mlp.gate"]
"""What a release quantizing attention and shared experts too excludes: the LM head and routers."""


def hf_quant_config(exclude: list[str]) -> dict:
    return {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": GROUP,
            "exclude_modules": exclude,
        },
    }


def quantize_checkpoint(folder: str | Path, all_linears: bool = False) -> None:
    """Quantize `folder`'s routed experts (with `all_linears`, every linear layer but the routers
    and the LM head) in place and write hf_quant_config.json."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_quantized(name, tensor, all_linears):
            return {name: unquantized(name, tensor)}
        module = name.removesuffix(".weight")
        codes, scale, global_scale = quantize(tensor)
        # The activations' scale a calibration would find for inputs of magnitude up to 1.
        input_scale = torch.tensor(1.0 / (6.0 * SCALE_MAX))
        return {
            name: codes,
            f"{module}.weight_scale": scale,
            f"{module}.weight_scale_2": global_scale,
            f"{module}.input_scale": input_scale,
        }

    rewrite_tensors(folder, rewrite)
    dense = [DENSE_LAYERS.format(i) for i in range(config.get("first_k_dense_replace", 0))]
    exclude = EXCLUDED_ALL_LINEARS if all_linears else EXCLUDED + dense
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(exclude), indent=2) + "\n")
