"""Rewrite a DeepSeek-V4 checkpoint transformers wrote as DeepSeek's FP8 + FP4-experts release
lays it out, and write the dequantized twin transformers runs as the reference.

transformers saves V4 in the release's tensor names under `model.` (but for its embeddings,
final norm and hyper head, under their module names). The release (V4-Flash, V4-Pro):
- names at the top level: `embed.weight`, `norm.weight`, `head.weight`, `hc_head_fn`, ...;
- every linear layer FP8 e4m3 in 128x128 blocks with power-of-two scales (`scale_fmt: ue8m0`)
  stored as e8m0 bytes under `<module>.scale`, but the embeddings, the LM head, the routers'
  gates, and the compressors' and indexer's projections (`wkv`, `wgate`, `weights_proj`), which
  it keeps unquantized, as it keeps the norms and hyper-connections;
- the routed experts' w1/w2/w3 as FP4 (`expert_dtype: fp4`): e2m1 codes two per int8, the
  first input in the low nibble, with one e8m0 scale per 32 inputs of a row (`<module>.scale`).
The base models' release (V4-Flash-Base, `expert_dtype: fp8`) has FP8 experts like its other
linears, and every FP8 scale float32 (still powers of two).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import fp8_format, mxfp4_format
from moeserve.checkpoints.rewrite import INDEX_FILE, Rewrite, rewrite_checkpoint

BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": list(BLOCK),
}
E8M0 = torch.float8_e8m0fnu
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_KEPT = re.compile(r".*\.(ffn\.gate|compressor\.wkv|compressor\.wgate|indexer\.weights_proj)\.weight")
"""Layer linears the release keeps unquantized (routers, compressor and indexer-head projections)."""


def released_name(name: str) -> str:
    """The release's name of a tensor transformers saved as `name`."""
    return _TOP.get(name, name.removeprefix("model."))


def _rewriter(expert_dtype: str) -> Rewrite:
    fp4 = expert_dtype == "fp4"
    scale_dtype = E8M0 if fp4 else torch.float32

    def rewrite(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = released_name(name)
        scale = fp8_format.released_v4_scale_name(name)
        if fp4 and _ROUTED.fullmatch(name):
            blocks, scales = mxfp4_format.quantize(tensor)
            return {name: blocks.flatten(-2).view(torch.int8), scale: scales.view(E8M0)}
        if name.startswith("layers.") and tensor.dim() == 2 and name.endswith(".weight") and not _KEPT.fullmatch(name):
            weight, scale_inv = fp8_format.quantize(tensor, BLOCK, ue8m0=True)
            return {name: weight, scale: scale_inv.to(scale_dtype)}
        return {name: tensor}

    return rewrite


def quantize_checkpoint(folder: str | Path, expert_dtype: str = "fp4") -> None:
    """Rewrite `folder` (a V4 checkpoint in transformers' layout) in place in the release's
    layout and quantization, its routed experts in `expert_dtype` (fp4, or fp8 as the base
    models' release), and declare it in config.json as the release does."""
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert_dtype!r}: DeepSeek-V4 releases fp4 or fp8 experts")
    fields = {"quantization_config": dict(QUANTIZATION_CONFIG), "expert_dtype": expert_dtype}
    rewrite_checkpoint(Path(folder), "DeepseekV4ForCausalLM", "V4's FP8 release", _rewriter(expert_dtype), fields)


def write_dequantized_twin(quantized: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write to `out` the values `quantized` (a release-layout V4 checkpoint) stores, in `dtype`,
    as transformers lays V4 out and with no quantization_config: what transformers runs for the
    greedy tokens a server of `quantized` must give."""
    quantized, out = Path(quantized), Path(out)
    shutil.copytree(quantized, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE))
    ours = {v: k for k, v in _TOP.items()}
    values: dict[str, torch.Tensor] = {}
    for file in sorted(quantized.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, tensor in tensors.items():
            if name.endswith(fp8_format.RELEASED_V4_SCALE):
                continue
            scale = tensors.get(fp8_format.released_v4_scale_name(name))
            if scale is None:
                value = tensor
            elif tensor.dtype == torch.int8:  # FP4 expert
                blocks = tensor.view(torch.uint8).unflatten(-1, (-1, mxfp4_format.BYTES_PER_BLOCK))
                value = mxfp4_format.dequantize(blocks, scale.view(torch.uint8), dtype)
            else:
                value = fp8_format.dequantize(tensor, scale.float()[None], BLOCK, dtype)
            is_float = value.is_floating_point()
            values[ours.get(name, name if name == "head.weight" else f"model.{name}")] = (
                value.to(dtype) if is_float else value
            )
    save_file(values, out / "model.safetensors", metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"], config["expert_dtype"]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out
