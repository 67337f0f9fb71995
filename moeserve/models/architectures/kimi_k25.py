"""Kimi-K2.5 (`KimiK25ForConditionalGeneration`) served as its text model: a DeepSeek-V3
architecture (MLA, grouped sigmoid routing, shared experts) whose config sits under
`text_config` and whose tensors sit under `language_model.` in the multimodal checkpoint; its
routed experts are published INT4 (compressed-tensors pack-quantized, `models/int4.py`). The
vision tower's tensors are never read, and requests with image parts are refused by the API.
"""

from __future__ import annotations

from moeserve.models.architectures import deepseek
from moeserve.models.architectures.base import Architecture, CheckpointNames

ARCHITECTURE = Architecture(
    hf_names=("KimiK25ForConditionalGeneration",),
    parse_config=deepseek.parse_config,
    names=CheckpointNames(
        shared_expert="shared_experts",
        model_prefix="language_model.model.",
        lm_head="language_model.lm_head.weight",
    ),
    text_config=True,
)
