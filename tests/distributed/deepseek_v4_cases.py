"""Per-rank body of the DeepSeek-V4 expert-parallel run (spawned: it must live in a module)."""

from __future__ import annotations

from helpers.v4_greedy import greedy_in_chunks

from moeserve.dispatch import ExpertPlacement, create_dispatcher
from moeserve.models import load_model


def rank_greedy(rank: int, world_size: int, folder: str, prompts: list[list[int]], num_steps: int):
    """This rank's prompt (one per rank, data-parallel attention) through experts spread over the
    ranks by the `torch` all-to-all dispatcher: (its greedy tokens, no block leaked)."""
    placement = ExpertPlacement.contiguous(8, world_size, rank)
    model = load_model(folder, dispatcher=create_dispatcher("torch", placement))
    tokens, no_leak = greedy_in_chunks(model, [prompts[rank]], num_steps)
    return tokens[0], no_leak
