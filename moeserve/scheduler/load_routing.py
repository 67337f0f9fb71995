"""Token-aware placement of requests on data-parallel groups: by predicted time, not by count.

Groups step in lockstep, so every step lasts as long as its slowest group's share. Counting
requests treats a 16-token chat turn like a 4,000-token document and a slow group like a fast
one. Instead each group keeps its own `StepTimeModel`, fitted to the time its ranks took for its
own share of every step it had work in, and a new request goes to the group that would finish
its backlog soonest with the request added: the backlog's step shape (decodes, the rest of the
running prefill, queued prompts) priced by that group's fitted coefficients. A straggler (larger
coefficients for the same work) thus takes work only when the others are that much busier.

Until every group's model has seen enough steps (`StepTimeModel.ready`), groups are compared by
their backlog's tokens alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from moeserve.scheduler.step_time import StepShape, StepTimeModel


class TimeRouter:
    """One step-time model per group, and the choice of a group for a new request."""

    def __init__(self, num_groups: int, max_num_batched_tokens: int) -> None:
        if num_groups < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"num_groups and max_num_batched_tokens must be >= 1, got {num_groups}, {max_num_batched_tokens}"
            )
        self.models = [StepTimeModel() for _ in range(num_groups)]
        self.budget = max_num_batched_tokens

    def keeping(self, groups: Sequence[int]) -> TimeRouter:
        """This router over `groups` only (old indices, in their new order), each keeping what
        its model learnt: after a heal, the groups that survived."""
        router = TimeRouter(len(groups), self.budget)
        router.models = [self.models[g] for g in groups]
        return router

    def growing(self, count: int) -> TimeRouter:
        """This router with `count` new groups after the others (returned ranks), each with a
        fresh model that learns from its own steps."""
        router = TimeRouter(len(self.models) + count, self.budget)
        router.models[: len(self.models)] = self.models
        return router

    @property
    def ready(self) -> bool:
        """Every group's model can price work (each has seen enough of its own steps)."""
        return all(model.ready for model in self.models)

    def observe(self, group: int, shape: StepShape, duration_s: float) -> None:
        """Group `group`'s ranks took `duration_s` for their share of a step, of shape `shape`."""
        self.models[group].observe(shape, duration_s)

    def cost(self, group: int, backlog: StepShape) -> float:
        """Seconds group `group` needs for `backlog` (the shape of one step holding all of it),
        spread over as many steps as the token budget makes it: each pays the fixed cost once.
        Before every model is ready: the backlog's tokens, a unit every group shares."""
        if not self.ready:
            return float(backlog.num_tokens)
        model = self.models[group]
        steps = max(1, math.ceil(backlog.num_tokens / self.budget))
        return model.predict(backlog) + (steps - 1) * model.coefficients[0]

    def choose(self, backlogs: Sequence[StepShape], request_tokens: int, tie_key: Callable[[int], tuple]) -> int:
        """The group whose backlog, with a new request's `request_tokens` prompt tokens added,
        costs least; `tie_key(g)` orders groups of equal cost."""

        def key(group: int) -> tuple:
            return (self.cost(group, backlogs[group].plus_chunk(request_tokens, 0)), tie_key(group))

        return min(range(len(self.models)), key=key)
