"""Rank body of test_quantized_rebalance.py (spawned ranks import their function from a module)."""

from __future__ import annotations

import torch
from helpers.load_only import LoadOnly

from moeserve.dispatch import ExpertMap
from moeserve.eplb import move_experts
from moeserve.models import load_model


def moved_equals_loaded(rank: int, world_size: int, folders: list[str], old: ExpertMap, new: ExpertMap) -> list[str]:
    """For each checkpoint: load this rank's share under `old`, move it to `new` rank to rank,
    and list the expert tensors (stored bytes and scales alike) that differ from a load under `new`."""
    placement = old.slot_placement(rank)
    differ = []
    for folder in folders:
        moved = load_model(folder, dispatcher=LoadOnly(placement), expert_map=old)
        move_experts([b.experts for b in moved.moe_blocks()], old, new, rank)
        fresh = load_model(folder, dispatcher=LoadOnly(placement), expert_map=new).state_dict()
        differ += [
            f"{folder}: {name}"
            for name, value in moved.state_dict().items()
            if ".experts." in name and not torch.equal(value.view(torch.uint8), fresh[name].view(torch.uint8))
        ]
    return differ
