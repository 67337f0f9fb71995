"""Which `quantization_config.quant_method` values the loader serves: one list, one refusal.

Checked before any architecture reads its config, so a checkpoint of an unsupported format
(AWQ, GPTQ, bitsandbytes, NVFP4, ...) is turned away by name whatever its architecture,
rather than failing later on a tensor name or dtype it cannot explain.
"""

from __future__ import annotations

from typing import Any

from moeserve.models.checkpoint import CheckpointError

SUPPORTED_QUANT_METHODS: tuple[str, ...] = ()
"""quant_method values the loader reads; empty: bf16/fp16/fp32 checkpoints only."""


def check_quantization(raw_config: dict[str, Any]) -> None:
    """Refuse a quantized checkpoint whose method is not supported, naming it and the supported ones."""
    quant = raw_config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method in SUPPORTED_QUANT_METHODS:
        return
    supported = ", ".join(SUPPORTED_QUANT_METHODS) or "none yet"
    raise CheckpointError(
        f"quantization_config.quant_method {method!r} is not supported (supported quant methods: {supported}); "
        "use a bf16/fp16/fp32 checkpoint"
    )
