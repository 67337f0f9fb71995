"""Which `quantization_config.quant_method` values the loader serves: one list, one refusal.

Checked before any architecture reads its config, so a checkpoint of an unsupported format
(AWQ, GPTQ, bitsandbytes, ...) or an unsupported setting of a supported one (a compressed-tensors
`format` other than pack-quantized, a ModelOpt `quant_algo` other than NVFP4) is turned away by
name, with the field, whatever its architecture,
rather than failing later on a tensor name or dtype it cannot explain. MXFP4 exists for
gpt-oss's experts only (as in transformers), so another architecture declaring it is refused here
too; which tensors a checkpoint holds in it is the loader's check (`models/mxfp4.py`).
"""

from __future__ import annotations

from typing import Any

from moeserve.config import BlockFP8Config, MXFP4Config, NVFP4Config, PackedInt4Config, WeightQuant
from moeserve.models.checkpoint import CheckpointError

SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("fp8", "mxfp4", "compressed-tensors", "modelopt")
"""quant_method values the loader reads besides bf16/fp16/fp32: fp8 = block-quantized e4m3
weights with float32/bfloat16/float16 inverse scales, dynamic activations (DeepSeek-V3/R1, Qwen3-FP8); mxfp4 =
gpt-oss's routed experts as e2m1 codes with a power-of-two scale per 32 values; compressed-tensors =
its pack-quantized INT4 W4A16 (Kimi-K2-Thinking, Kimi-K2.5); modelopt = NVIDIA's NVFP4 releases."""
INT4_FORMAT = "pack-quantized"
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
"""The one compressed-tensors weight scheme read: what Kimi-K2's INT4 releases declare."""
NVFP4_ALGO, NVFP4_GROUP = "NVFP4", 16
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)  # what transformers reads MXFP4 experts for
SCALE_FORMATS = ("float", "ue8m0")
"""FP8 `scale_fmt`s: any float scale (DeepSeek-V3), or powers of two only (DeepSeek-V3.1, V4)."""
EXPERT_DTYPES = ("fp8", "fp4")
"""FP8 releases' `expert_dtype`s: FP8 experts like every other linear, or DeepSeek-V4's FP4 experts."""


def check_quantization(raw_config: dict[str, Any]) -> WeightQuant | None:
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
    if method == "compressed-tensors":
        return _int4_config(quant)
    if method == "modelopt":
        return _nvfp4_config(quant)
    return _fp8_config(quant, raw_config)


def _names(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise CheckpointError(f"quantization_config.{field} should be a list of module names, got {value!r}")
    return tuple(value)


def _int4_config(quant: dict[str, Any]) -> PackedInt4Config:
    """compressed-tensors: every config group must be the pack-quantized INT4 W4A16 scheme, one group size."""
    fmt = quant.get("format")
    if fmt != INT4_FORMAT:
        raise CheckpointError(
            f"quant_method 'compressed-tensors' with quantization_config.format {fmt!r}: "
            f"only {INT4_FORMAT!r} (INT4 weights packed in int32) is supported"
        )
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"quantization_config.config_groups should name at least one group, got {groups!r}")
    targets: list[str] = []
    sizes = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise CheckpointError(f"{where}.weights should be a weight scheme, got {group!r}")
        if group.get("format", fmt) != INT4_FORMAT:
            raise CheckpointError(f"{where}.format {group['format']!r}: only {INT4_FORMAT!r} is supported")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(f"{where} quantizes activations: only weight-only (W4A16) schemes are supported")
        weights = group["weights"]
        for field, want in INT4_WEIGHTS.items():
            if weights.get(field) != want:
                raise CheckpointError(
                    f"{where}.weights.{field} is {weights.get(field)!r}: only {want!r} is supported "
                    f"(symmetric INT4 in groups: {INT4_WEIGHTS})"
                )
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % 8:
            raise CheckpointError(f"{where}.weights.group_size should be a positive multiple of 8, got {size!r}")
        sizes.add(size)
        targets += _names(group.get("targets"), f"config_groups.{name}.targets")
    if len(sizes) > 1:
        raise CheckpointError(
            f"quantization_config.config_groups use group sizes {sorted(sizes)}: only one is supported"
        )
    return PackedInt4Config(sizes.pop(), tuple(targets), _names(quant.get("ignore") or [], "ignore"))


def _nvfp4_config(quant: dict[str, Any]) -> NVFP4Config:
    """ModelOpt, in either form its releases write: hf_quant_config.json's `quantization` section
    (`exclude_modules`) or config.json's flat one (`ignore`)."""
    section, excluded = (quant["quantization"], "exclude_modules") if "quantization" in quant else (quant, "ignore")
    if not isinstance(section, dict):
        raise CheckpointError(f"quantization_config.quantization should be a mapping, got {section!r}")
    algo = section.get("quant_algo")
    if algo != NVFP4_ALGO:
        raise CheckpointError(f"quant_method 'modelopt' with quant_algo {algo!r}: only {NVFP4_ALGO!r} is supported")
    size = section.get("group_size", NVFP4_GROUP)
    if size != NVFP4_GROUP:
        raise CheckpointError(f"quant_algo 'NVFP4' with group_size {size!r}: NVFP4 scales blocks of {NVFP4_GROUP}")
    if section.get("kv_cache_quant_algo") is not None:
        raise CheckpointError(
            f"quant_algo 'NVFP4' with kv_cache_quant_algo {section['kv_cache_quant_algo']!r}: "
            "quantized KV cache scales are not read; only kv_cache_quant_algo null is supported"
        )
    return NVFP4Config(_names(section.get(excluded) or [], excluded))


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


def _fp8_config(quant: dict[str, Any], raw_config: dict[str, Any]) -> BlockFP8Config:
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
    scale_fmt = quant.get("scale_fmt") or "float"
    if scale_fmt not in SCALE_FORMATS:
        raise CheckpointError(
            f"quant_method 'fp8' with scale_fmt {scale_fmt!r}: only {' and '.join(map(repr, SCALE_FORMATS))} "
            "are supported"
        )
    # DeepSeek-V4 says it at the top level, V4.1 in quantization_config (where transformers moves it).
    experts = quant.get("expert_dtype", raw_config.get("expert_dtype")) or "fp8"
    if experts not in EXPERT_DTYPES:
        raise CheckpointError(
            f"quant_method 'fp8' with expert_dtype {experts!r}: only {' and '.join(map(repr, EXPERT_DTYPES))} "
            "are supported"
        )
    kept = _names(quant.get("modules_to_not_convert") or [], "modules_to_not_convert")
    return BlockFP8Config(
        block=(block[0], block[1]), not_converted=kept, ue8m0=scale_fmt == "ue8m0", fp4_experts=experts == "fp4"
    )
