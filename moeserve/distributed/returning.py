"""A rank process that comes back (`--on-rank-failure heal`): restarted with the flags it was
launched with, after the others healed over its loss.

It tells from the store that the group went on without it (`GENERATION_KEY` above 0), so it does
not wait for the launch's rendezvous, whose other members have long moved on. It loads its share
of the model as at launch (dense weights from the checkpoint; expert slots as at launch, which
the regroup replaces), reports to node 0 and waits: at the engine's next step node 0 publishes a
`Regroup` with it appended to the members, it forms the new group with the others, and only then
does it own a dispatcher. Until then its MoE layers hold `AwaitingGroup`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeserve.dispatch.base import Dispatcher, DispatchHandle, DispatchOutput
from moeserve.distributed.rendezvous import GENERATION_KEY, get


def is_returning(store: dist.Store) -> bool:
    """Whether the ranks' group has been regrouped since launch, i.e. this process comes back
    into a running engine rather than starting with it (waits for node 0 to publish the key)."""
    return get(store, GENERATION_KEY) > 0


class AwaitingGroup(Dispatcher):
    """The dispatcher of a returned rank's model before it joined a process group: it knows its
    slots (what the model loads), but every all-to-all needs the group, so running a step now is
    a bug (node 0 sends no step to a rank that is not a member)."""

    name = "awaiting-group"

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> DispatchOutput:
        raise RuntimeError("this rank has not joined the ranks' process group yet")

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        raise RuntimeError("this rank has not joined the ranks' process group yet")
