"""The gated activation between an expert's two GEMMs, in a kernel's epilogue (`GatedActivation`).

The kind, and gpt-oss's and DeepSeek-V4's constants, are compile-time choices: a model's kernel
holds only its own arithmetic, and the plain SiLU kernels of every other model compile as they
did before the clamped kinds existed (the same code, their constants fixed).

* silu: silu(gate) * up.
* clamped_silu (DeepSeek-V4): gate clamped above at LIMIT, up to [-LIMIT, LIMIT], then
  silu(gate) * up.
* clamped_swiglu (gpt-oss): the same clamps, then (up + 1) * gate * sigmoid(ALPHA * gate).

These are `moeserve.gated_activation.gated`'s, the torch path's, on the float32 accumulators.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.config import GatedActivation


@triton.jit
def gated_activation(gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    if ACTIVATION != "silu":
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if ACTIVATION == "clamped_swiglu":
        return (up + 1.0) * (gate * tl.sigmoid(gate * ALPHA))
    return gate * tl.sigmoid(gate) * up


def activation_constants(activation: GatedActivation | None) -> dict[str, str | float]:
    """The kernels' constexprs for `activation` (None: silu). SiLU's constants are fixed, so
    whatever a config's unused alpha and limit are, a SiLU model gets the one plain kernel."""
    if activation is None or activation.kind == "silu":
        return {"ACTIVATION": "silu", "ALPHA": 0.0, "LIMIT": 0.0}
    alpha = float(activation.alpha) if activation.kind == "clamped_swiglu" else 0.0  # clamped SiLU has none
    return {"ACTIVATION": activation.kind, "ALPHA": alpha, "LIMIT": float(activation.limit)}
