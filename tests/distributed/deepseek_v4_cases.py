"""Per-rank body of the DeepSeek-V4 expert-parallel run (spawned: it must live in a module)."""

from __future__ import annotations

import torch.distributed as dist
from helpers.v4_greedy import greedy_in_chunks

from moeserve.dispatch import ExpertPlacement, create_dispatcher
from moeserve.models import load_model
from moeserve.models.tensor_parallel import SINGLE, TensorParallel


def rank_greedy(rank: int, world_size: int, folder: str, prompts: list[list[int]], num_steps: int, tp: int):
    """Experts spread over the ranks by the `torch` all-to-all dispatcher, attention in groups of
    `tp` consecutive ranks, group g running `prompts[g]`: (this rank's greedy tokens, no block leaked)."""
    groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, world_size, tp)] if tp > 1 else []
    parallel = TensorParallel(rank % tp, tp, groups[rank // tp]) if tp > 1 else SINGLE
    placement = ExpertPlacement.contiguous(8, world_size, rank)
    model = load_model(folder, dispatcher=create_dispatcher("torch", placement), tp=parallel)
    tokens, no_leak = greedy_in_chunks(model, [prompts[rank // tp]], num_steps)
    return tokens[0], no_leak
