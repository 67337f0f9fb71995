"""A checkpoint whose router prefers a few experts: the skewed load expert balancing is for.

DeepSeek-V3's router picks the top-k of sigmoid scores plus a per-expert correction bias, and
weights the picks by the unbiased scores; a Zipf-like bias therefore skews which experts are
picked (hot ones nearly always, cold ones rarely) without changing the rest of the model. Each
MoE layer gets its own random order of hot experts, as real routers do.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def skew_router(folder: Path, target: Path, strength: float, exponent: float = 1.0, seed: int = 0) -> Path:
    """A copy of `folder` at `target` whose correction biases are `strength / rank^exponent`
    over a random order of the experts per layer (rank 1 the hottest)."""
    shutil.copytree(folder, target)
    g = torch.Generator().manual_seed(seed)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        for name, bias in tensors.items():
            if name.endswith("e_score_correction_bias"):
                order = torch.randperm(bias.numel(), generator=g)
                zipf = strength / torch.arange(1, bias.numel() + 1, dtype=torch.float32) ** exponent
                tensors[name] = torch.empty_like(bias).index_copy_(0, order, zipf.to(bias.dtype))
        save_file(tensors, path, metadata={"format": "pt"})
    return target
