"""DeepSeek-V4's rotary: interleaved pairs on the last `rotary_dim` channels of each head (the
first ones stay as they are), from a `RopeConfig` (the main one, or the compressed branches' YaRN)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import RopeConfig
from moeserve.models.layers.rotary import inv_freq_and_scale


class TailRotary(nn.Module):
    def __init__(self, cfg: RopeConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[S]` -> cos, sin `[S, rotary_dim / 2]` (one per pair)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[S, ..., D]` with cos, sin `[S, r / 2]` (broadcast over the middle axes): the last r
    channels rotated pair by pair in float32; pass -sin to rotate back."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape).float(), sin.reshape(shape).float()
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
