"""What the DeepSeek Sparse Attention tests share: a checkpoint's config and seeded prompts."""

from __future__ import annotations

import json

import torch

from moeserve.config import ModelConfig
from moeserve.models import resolve_architecture


def config_of(folder) -> ModelConfig:
    return resolve_architecture(json.loads((folder / "config.json").read_text()))[1]


def prompts_for(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(4000 + seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]
