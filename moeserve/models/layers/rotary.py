"""Rotary position embeddings: default, linear and YaRN frequency schedules.

`RotaryEmbedding.cos_sin(positions)` is computed once per step and shared by all layers.
Two layouts: `rotate_half` (halves rotate together; Llama/Mixtral/Qwen) and interleaved pairs
(DeepSeek checkpoints with `rope_interleave`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp in between (arXiv 2309.00071)."""
    dim, base, factor = cfg.rotary_dim, cfg.theta, cfg.factor
    if cfg.original_max_position_embeddings is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def inv_freq_and_scale(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim / 2]` and the factor applied to cos/sin."""
    if cfg.kind == "yarn":
        return _yarn_inv_freq(cfg)
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32) / cfg.rotary_dim))
    if cfg.kind == "linear":
        inv_freq = inv_freq / cfg.factor
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RopeConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        inv_freq, self.scale = inv_freq_and_scale(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` -> cos, sin `[T, rotary_dim]` (the two halves repeat the frequencies)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
