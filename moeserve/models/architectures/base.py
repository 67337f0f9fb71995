"""What an architecture module declares: how to read its config.json and name its tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from moeserve.config import DTYPES, ModelConfig, RopeConfig
from moeserve.models.checkpoint import CheckpointError


@dataclass(frozen=True)
class CheckpointNames:
    """The checkpoint's tensor names where they differ between architectures.

    Everything else (`model.layers.N.self_attn.q_proj`, `input_layernorm`, ...) is common to
    all supported architectures and spelled once in `moeserve/models/loader.py`.
    """

    moe: str = "mlp"  # Mixtral: block_sparse_moe
    router: str = "gate"
    expert_gate: str = "gate_proj"  # Mixtral: w1
    expert_up: str = "up_proj"  # Mixtral: w3
    expert_down: str = "down_proj"  # Mixtral: w2
    shared_expert: str = "shared_expert"  # DeepSeek: shared_experts
    shared_expert_gate: str = "shared_expert_gate"
    correction_bias: str = "gate.e_score_correction_bias"  # under the MoE module; MiniMax-M2: on the block itself
    fused_experts: bool = False
    """gpt-oss: a layer's experts in four stacked tensors (`experts.gate_up_proj [E, H, 2I]` with
    gate and up columns interleaved, `experts.down_proj [E, I, H]`, and their biases), not one
    tensor per expert and projection."""
    fused_layout: Literal["gpt_oss", "rows"] = "gpt_oss"
    """How fused experts are laid out: gpt-oss's (above), or `rows`, as transformers 5 holds
    experts and Qwen3.5 releases them: `experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows)
    and `experts.down_proj [E, H, I]`, each expert already our `[out, in]`."""
    model_prefix: str = "model."
    """Before the decoder's tensor names (`layers.N.`, `embed_tokens`, `norm`). A multimodal
    checkpoint keeps its text model beside a vision tower that is never read, so deeper:
    Kimi-K2.5's under `language_model.model.`, Qwen3.5's under `model.language_model.`."""
    lm_head: str = "lm_head.weight"
    """The output projection, outside the decoder: Kimi-K2.5's `language_model.lm_head.weight`,
    Qwen3.5's at the top level as in a text checkpoint."""
    mtp_layout: Literal["deepseek", "qwen"] = "deepseek"
    """Where the multi-token prediction layer's tensors are: DeepSeek's, as decoder layer
    `num_hidden_layers + i` with its own embedding and head (`models/mtp.py`); or Qwen3-Next's and
    Qwen3.5's, at the top level under `mtp.` (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
    `layers.0.`, `norm`), sharing the target's embedding and lm_head."""


@dataclass(frozen=True)
class Architecture:
    hf_names: tuple[str, ...]  # config.json `architectures` values this module serves
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    names: CheckpointNames
    text_config: bool = False
    """The text model's config.json keys sit under `text_config` (a multimodal checkpoint served
    as its text model: Kimi-K2.5, Qwen3.5-MoE); its quantization_config there or at the top level."""


class HFConfig:
    """Typed access to a config.json dict: every missing or mistyped key is one clear error."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.architecture = (raw.get("architectures") or ["?"])[0]

    def require(self, *keys: str, kind: type = int) -> Any:
        """The first of `keys` present (aliases: `num_experts` / `num_local_experts`), checked."""
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                value = self.raw[key]
                if kind is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise CheckpointError(
                        f"config.json key {key!r} should be {kind.__name__}, got {value!r} ({self.architecture})"
                    )
                return value
        names = " or ".join(repr(k) for k in keys)
        raise CheckpointError(f"config.json is missing {names}, needed by {self.architecture}")

    def model_config(self, **fields: Any) -> ModelConfig:
        """A ModelConfig from the keys every architecture reads alike (sizes, norms, positions,
        tied embeddings, eos, dtype), with `fields` for the rest and for any the architecture
        spells differently (DeepSeek's MLA head shape)."""
        num_heads = self.require("num_attention_heads")
        common: dict[str, Any] = {
            "architecture": self.architecture,
            "vocab_size": self.require("vocab_size"),
            "hidden_size": self.require("hidden_size"),
            "num_layers": self.require("num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": self.get("num_key_value_heads", num_heads),
            "head_dim": self.head_dim(),
            "intermediate_size": fields["intermediate_size"]
            if "intermediate_size" in fields  # Qwen3.5: no dense layers, no such key
            else self.require("intermediate_size"),
            "rms_norm_eps": self.require("rms_norm_eps", kind=float),
            "max_position_embeddings": self.require("max_position_embeddings"),
            "tie_word_embeddings": bool(self.get("tie_word_embeddings", False)),
            "eos_token_ids": self.eos_token_ids(),
            "checkpoint_dtype": self.dtype(),
        }
        return ModelConfig(**{**common, **fields})

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def head_dim(self) -> int:
        return self.get("head_dim", None) or self.require("hidden_size") // self.require("num_attention_heads")

    def rotary_dim(self, head_dim: int, default_factor: float = 1.0) -> int:
        """Rotated dims of a head: `partial_rotary_factor` (in rope_parameters or top level), else
        MiniMax-M2's legacy `rotary_dim`, else `default_factor` (the architecture's transformers
        default); int(head_dim * factor) as transformers computes it."""
        params = self.raw.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor"))
        if factor is None and self.raw.get("rotary_dim") is not None:
            factor = self.raw["rotary_dim"] / head_dim
        return int(head_dim * float(factor if factor is not None else default_factor))

    def rope(
        self,
        rotary_dim: int,
        interleaved: bool = False,
        default_theta: float = 10000.0,
        default_scaling: dict[str, Any] | None = None,
    ) -> RopeConfig:
        """rope_parameters (transformers 5) or rope_theta + rope_scaling (older checkpoints);
        `default_theta` / `default_scaling`: what the architecture's transformers config assumes
        when config.json says nothing (gpt-oss: YaRN)."""
        params = dict(self.raw.get("rope_parameters") or {})
        scaling = dict(self.raw.get("rope_scaling") or {})
        params = {**scaling, **params}
        if default_scaling and "rope_type" not in params and "type" not in params:
            params = {**default_scaling, **params}
        theta = params.get("rope_theta", self.raw.get("rope_theta", default_theta))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "linear", "yarn"):
            raise CheckpointError(f"rope type {kind!r} is not supported (supported: default, linear, yarn)")
        return RopeConfig(
            theta=float(theta),
            rotary_dim=rotary_dim,
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", self.raw.get("max_position_embeddings")
            ),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            interleaved=interleaved,
        )

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    def dtype(self) -> torch.dtype:
        name = self.raw.get("dtype") or self.raw.get("torch_dtype") or "float32"
        return DTYPES.get(name, torch.float32)

    def check_activation(self) -> None:
        act = self.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported (only silu)")
        if self.raw.get("mlp_bias"):
            raise CheckpointError("MLP biases (mlp_bias: true) are not supported")

    def sliding_windows(self, num_layers: int, enabled: bool) -> tuple[int | None, ...]:
        """Per-layer window from `layer_types` when present, else one window for all layers."""
        window = self.raw.get("sliding_window") if enabled else None
        layer_types = self.raw.get("layer_types")
        if window and layer_types:
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        return (window or None,) * num_layers
