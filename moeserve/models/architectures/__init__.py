"""Registry of supported architectures, keyed by config.json `architectures` names."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeserve.config import ModelConfig
from moeserve.models.architectures import (
    deepseek,
    deepseek_v4,
    deepseek_v32,
    glm4_moe,
    gpt_oss,
    kimi_k25,
    minimax_m2,
    mixtral,
    olmoe,
    qwen3_next,
    qwen_moe,
)
from moeserve.models.architectures.base import Architecture, CheckpointNames
from moeserve.models.architectures.quantization import SUPPORTED_QUANT_METHODS, check_quantization
from moeserve.models.checkpoint import CheckpointError

ARCHITECTURES: dict[str, Architecture] = {
    name: arch
    for arch in (
        *(
            m.ARCHITECTURE
            for m in (
                mixtral,
                qwen_moe,
                deepseek,
                deepseek_v32,
                deepseek_v4,
                olmoe,
                glm4_moe,
                minimax_m2,
                gpt_oss,
                kimi_k25,
            )
        ),
        *qwen3_next.ARCHITECTURES,
    )
    for name in arch.hf_names
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve_architecture(raw_config: dict[str, Any]) -> tuple[Architecture, ModelConfig]:
    """The architecture serving this config.json, and the config normalised by it."""
    names = raw_config.get("architectures") or []
    if not names:
        raise CheckpointError(
            f"config.json has no 'architectures' entry; supported: {', '.join(supported_architectures())}"
        )
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise CheckpointError(
            f"architecture {names[0]!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    if arch.text_config:
        raw_config = text_model_config(raw_config)
    weight_quant = check_quantization(raw_config)
    try:
        return arch, dataclasses.replace(arch.parse_config(raw_config), weight_quant=weight_quant)
    except CheckpointError:
        raise
    except ValueError as e:  # ModelConfig's own consistency checks
        raise CheckpointError(f"inconsistent config.json for {names[0]}: {e}") from None


def text_model_config(raw_config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json as its text model's: `text_config`'s keys, under the checkpoint's
    own architecture name, with the quantization_config wherever the release put it."""
    text = raw_config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(
            f"{raw_config['architectures'][0]} keeps its text model's config under 'text_config', which is missing"
        )
    quant = text.get("quantization_config") or raw_config.get("quantization_config")
    return {**text, "architectures": raw_config["architectures"], "quantization_config": quant}


__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_QUANT_METHODS",
    "Architecture",
    "CheckpointNames",
    "resolve_architecture",
    "supported_architectures",
]
