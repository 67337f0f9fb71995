"""Rewrite a DeepSeek-V3 or Qwen3-MoE checkpoint folder with INT4 routed experts, in the layout
Kimi-K2-Thinking and Kimi-K2.5 are published in (compressed-tensors `pack-quantized`).

Each routed expert projection (with `all_linears`, each linear layer) `<m>.weight` becomes
`<m>.weight_packed` (int32, 8 codes each), `<m>.weight_scale` (bfloat16, one per 32 inputs) and
`<m>.weight_shape` (`int4_format.py`); the rest is kept in bfloat16 (`packed_experts.py`).
config.json gets the published
`quantization_config`: one group targeting `Linear`, with every other linear layer in `ignore` by
name, as llm-compressor writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moeserve.checkpoints.packed_experts import is_quantized, linear_modules, unquantized
from moeserve.checkpoints.rewrite import rewrite_tensors
from moeserve.int4_format import quantize

GROUP = 32  # Kimi-K2's group size


def quantization_config(ignore: list[str], group: int = GROUP) -> dict:
    """The `quantization_config` Kimi-K2-Thinking publishes, with this checkpoint's ignore list."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
    }
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "pack-quantized",
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_checkpoint(folder: str | Path, group: int = GROUP, all_linears: bool = False) -> None:
    """Quantize `folder`'s routed experts (with `all_linears`, every linear layer but the routers
    and the LM head) in place and declare it in config.json."""
    folder = Path(folder)
    names: list[str] = []
    quantized: set[str] = set()

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        names.append(name)
        if not is_quantized(name, tensor, all_linears):
            return {name: unquantized(name, tensor)}
        module = name.removesuffix(".weight")
        quantized.add(module)
        packed, scale = quantize(tensor, group)
        return {
            f"{module}.weight_packed": packed,
            f"{module}.weight_scale": scale,
            f"{module}.weight_shape": torch.tensor(tensor.shape),
        }

    rewrite_tensors(folder, rewrite)
    ignore = [m for m in linear_modules(names) if m not in quantized]
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(ignore, group)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
