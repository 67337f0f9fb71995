"""Routing cases for dispatch tests: top-k expert ids with a known shape of load.

One meaning per kind, for every test that routes:
- "uniform": every expert equally likely;
- "skewed": most picks land on experts 0 and 1 (a hot pair, as real routers produce);
- "one_expert": every token's first choice is the last expert (one rank carries all first picks).
"""

from __future__ import annotations

import torch

ROUTING_KINDS = ("uniform", "skewed", "one_expert")


def routing(kind: str, num_tokens: int, num_experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """topk_ids `[T, K]` int64, distinct experts per token; T may be 0 (a rank with nothing to send)."""
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if kind == "skewed":
        scores[:, :2] += torch.tensor([3.0, 2.0])
    elif kind == "one_expert":
        scores[:, -1] = 2.0
    elif kind != "uniform":
        raise ValueError(f"unknown routing kind {kind!r}; one of {ROUTING_KINDS}")
    return scores.topk(top_k, dim=-1).indices
