"""Live rebalancing on a rank: count, and every `interval` steps rebalance between two steps.

A rebalance, on every rank of the EP group at the same step (each counts the lockstep steps it
ran, so all agree without a message):

1. sum the ranks' load windows (one all-reduce of `[num_layers, E]` counts),
2. run the balancer on the sums (a pure function: every rank computes the same new map),
3. move expert weights to their new slots rank to rank (`transfer.move_experts`),
4. swap the model's logical -> physical tables to the new map.

The step that follows dispatches under the new map; no request is paused or restarted, and as
every replica holds the same weights, greedy outputs do not change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.dispatch.expert_map import ExpertMap
from moeserve.eplb.balancer import balance, imbalance
from moeserve.eplb.transfer import move_experts
from moeserve.eplb.window import LoadWindow

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceReport:
    """One rebalance, as every rank computed it (times are the reporting rank's own).

    imbalance_before/after: (mean over MoE layers, worst layer) of max / mean rank load under the
                            window's loads, before and after (`balancer.imbalance`).
    """

    step: int
    imbalance_before: tuple[float, float]
    imbalance_after: tuple[float, float]
    experts_moved: int
    bytes_moved: int
    balance_s: float
    transfer_s: float

    def describe(self) -> str:
        return (
            f"rebalanced experts at step {self.step}: max/mean rank load {self.imbalance_before[0]:.3f} "
            f"(worst layer {self.imbalance_before[1]:.3f}) -> {self.imbalance_after[0]:.3f} "
            f"(worst {self.imbalance_after[1]:.3f}); moved {self.experts_moved} expert slots, "
            f"{self.bytes_moved / 2**20:.2f} MiB between ranks in {self.transfer_s * 1e3:.1f} ms "
            f"(+{self.balance_s * 1e3:.1f} ms to gather loads and plan)"
        )


class Rebalancer:
    """model: has `moe_blocks()` (each with `experts` and the logical load counter) and
    `set_expert_map(map, rank)`; group: the EP process group."""

    def __init__(
        self,
        model,
        expert_map: ExpertMap,
        rank: int,
        window_steps: int,
        interval_steps: int,
        num_nodes: int = 1,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.expert_map, self.rank = model, expert_map, rank
        self.interval_steps, self.num_nodes, self.group = interval_steps, num_nodes, group
        self.window = LoadWindow(model.moe_blocks(), window_steps)

    def record(self) -> bool:
        """After each step: snapshot the loads; True when this step ends with a rebalance."""
        self.window.record()
        return self.window.steps % self.interval_steps == 0

    def rebalance(self, before_swap: Callable[[ExpertMap], None] | None = None) -> RebalanceReport:
        """Every rank together (see the module docstring). before_swap(old map) runs after the
        weights moved and before the tables change (the rank flushes its per-slot counters)."""
        started = time.perf_counter()
        loads = self.window.loads()
        dist.all_reduce(loads, group=self.group)
        host = loads.tolist()
        old = self.expert_map
        new = balance(host, old.num_physical, old.ep_size, self.num_nodes, previous=old)
        planned = time.perf_counter()
        moved = move_experts([b.experts for b in self.model.moe_blocks()], old, new, self.rank, self.group)
        if before_swap is not None:
            before_swap(old)
        self.model.set_expert_map(new, self.rank)
        self.expert_map = new
        if torch.cuda.is_available() and loads.is_cuda:
            torch.cuda.synchronize(loads.device)
        done = time.perf_counter()
        return RebalanceReport(
            step=self.window.steps,
            imbalance_before=imbalance(old, host),
            imbalance_after=imbalance(new, host),
            experts_moved=moved.experts,
            bytes_moved=moved.bytes,
            balance_s=planned - started,
            transfer_s=done - planned,
        )
