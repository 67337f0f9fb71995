"""Which `quantization_config.quant_method` values the loader serves: one list, one refusal.

Checked before any architecture reads its config, so a checkpoint of an unsupported format
(AWQ, GPTQ, bitsandbytes, NVFP4, ...) is turned away by name whatever its architecture,
rather than failing later on a tensor name or dtype it cannot explain. MXFP4 exists for
gpt-oss's experts only (as in transformers), so another architecture declaring it is refused here
too; which tensors a checkpoint holds in it is the loader's check (`models/mxfp4.py`).
"""

from __future__ import annotations

from typing import Any

from moeserve.config import BlockFP8Config, MXFP4Config
from moeserve.models.checkpoint import CheckpointError

SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("fp8", "mxfp4")
"""quant_method values the loader reads besides bf16/fp16/fp32: fp8 = block-quantized e4m3
weights with float32/bfloat16/float16 inverse scales, dynamic activations (DeepSeek-V3/R1, Qwen3-FP8); mxfp4 =
gpt-oss's routed experts as e2m1 codes with a power-of-two scale per 32 values."""
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)  # what transformers reads MXFP4 experts for


def check_quantization(raw_config: dict[str, Any]) -> BlockFP8Config | MXFP4Config | None:
    """The checkpoint's weight quantization (None: none), or a refusal naming the method and
    the supported ones, or what of its config the loader cannot read."""
    quant = raw_config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method not in SUPPORTED_QUANT_METHODS:
        supported = ", ".join(SUPPORTED_QUANT_METHODS)
        raise CheckpointError(
            f"quantization_config.quant_method {method!r} is not supported (supported quant methods: "
            f"{supported}); use a bf16/fp16/fp32 checkpoint"
        )
    if method == "mxfp4":
        return _mxfp4_config(quant, raw_config.get("architectures") or [])
    return _fp8_config(quant)


def _mxfp4_config(quant: dict[str, Any], architectures: list[str]) -> MXFP4Config:
    if architectures[:1] != list(MXFP4_ARCHITECTURES):
        raise CheckpointError(
            f"quant_method 'mxfp4' is read for gpt-oss's experts only ({', '.join(MXFP4_ARCHITECTURES)}), "
            f"not {architectures[0] if architectures else 'a config without architectures'}"
        )
    skipped = quant.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(m, str) for m in skipped):
        raise CheckpointError(f"quantization_config.modules_to_not_convert should be a list of names, got {skipped!r}")
    return MXFP4Config()


def _fp8_config(quant: dict[str, Any]) -> BlockFP8Config:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"quant_method 'fp8' with fmt {fmt!r}: only e4m3 weights are supported")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(
            f"quant_method 'fp8' with activation_scheme {scheme!r}: only dynamic activation scales are supported"
        )
    block = quant.get("weight_block_size", [128, 128])  # transformers' default when absent
    if block is None:
        raise CheckpointError(
            "quant_method 'fp8' with weight_block_size null (per-tensor scales): only block-quantized FP8 is supported"
        )
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(f"quantization_config.weight_block_size should be two positive ints, got {block!r}")
    return BlockFP8Config(block=(block[0], block[1]))
