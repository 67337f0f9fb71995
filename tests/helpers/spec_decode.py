"""What the speculative decoding tests share: the engine shape, n-gram drafts, and prompts on
which a tiny random DeepSeek-V3 checkpoint keeps some drafts (its greedy outputs loop)."""

from __future__ import annotations

import torch

ENGINE = dict(block_size=4, max_model_len=96)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def looping_prompts() -> list[list[int]]:
    """Three random prompts and a repetitive one."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (6, 19, 31)] + [[40, 41, 42, 43] * 5]
