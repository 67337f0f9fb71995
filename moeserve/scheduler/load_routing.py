"""Token-aware placement of requests on data-parallel groups: by predicted time, not by count.

Groups step in lockstep, so every step lasts as long as its slowest group's share. Counting
requests treats a 16-token chat turn like a 4,000-token document and a slow group like a fast
one. Instead each group keeps its own `StepTimeModel`, fitted to the time its ranks took for its
own share of every step it had work in, and a new request goes to the group where its first
token is projected to come soonest (`Scheduler.project_first_token`: the group's seats, KV
blocks and prefill ahead, played forward at that group's fitted speed). A straggler (larger
coefficients for the same work) thus takes work only when the others are that much busier, and
a group whose batch or cache is full takes none while another can start the request at once.

Until every group's model has seen enough steps (`StepTimeModel.ready`), groups are compared by
their backlog's tokens alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moeserve.scheduler.step_time import StepShape, StepTimeModel


class TimeRouter:
    """One step-time model per group, and the choice of a group for a new request."""

    def __init__(self, num_groups: int) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.models = [StepTimeModel() for _ in range(num_groups)]

    def keeping(self, groups: Sequence[int]) -> TimeRouter:
        """This router over `groups` only (old indices, in their new order), each keeping what
        its model learnt: after a heal, the groups that survived."""
        router = TimeRouter(len(groups))
        router.models = [self.models[g] for g in groups]
        return router

    def growing(self, count: int) -> TimeRouter:
        """This router with `count` new groups after the others (returned ranks), each with a
        fresh model that learns from its own steps."""
        router = TimeRouter(len(self.models) + count)
        router.models[: len(self.models)] = self.models
        return router

    @property
    def ready(self) -> bool:
        """Every group's model can price work (each has seen enough of its own steps)."""
        return all(model.ready for model in self.models)

    def observe(self, group: int, shape: StepShape, duration_s: float) -> None:
        """Group `group`'s ranks took `duration_s` for their share of a step, of shape `shape`."""
        self.models[group].observe(shape, duration_s)

    def choose(
        self,
        first_token_s: Callable[[int, StepTimeModel], float],
        backlog_tokens: Callable[[int], int],
        tie_key: Callable[[int], tuple],
    ) -> int:
        """The group where a new request's first token comes soonest, `first_token_s(g, model)`
        timed by group g's own model; before every model is ready, the group with the fewest
        `backlog_tokens(g)`, a unit every group shares. `tie_key(g)` orders groups that tie."""
        groups = range(len(self.models))
        if self.ready:
            return min(groups, key=lambda g: (first_token_s(g, self.models[g]), tie_key(g)))
        return min(groups, key=lambda g: (backlog_tokens(g), tie_key(g)))
