"""Scheduling over data-parallel attention groups: one `Scheduler` per group, one plan per step.

With `ep` ranks and `tp`-way attention, `ep / tp` groups each own a KV cache and a set of
requests; the MoE layers join every group in each step. A request is placed in one group for
its whole life (its KV lives there): with prefix caching the one holding the longest prefix of
its prompt unless that one is much busier (`prefix_routing`), else the one with the least load
when it arrives: by default the soonest projected first token (`load_routing`), or
the fewest requests (`dp_routing="requests"`). All groups step together, so one step's plan
holds every group's plan, some of which may be empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from moeserve.scheduler.admission import AdmissionTally
from moeserve.scheduler.block_groups import GroupBlocks
from moeserve.scheduler.block_hash import block_hashes
from moeserve.scheduler.config import SchedulerConfig
from moeserve.scheduler.load_routing import TimeRouter
from moeserve.scheduler.prefix_routing import PrefixRouter
from moeserve.scheduler.request import Request
from moeserve.scheduler.scheduler import QueueFullError, ScheduledRequest, Scheduler, SchedulerOutput
from moeserve.scheduler.step_time import StepShape, StepTimeModel


@dataclass(frozen=True)
class StepPlan:
    """Every group's plan for one lockstep step; groups[g] runs on the ranks of group g."""

    groups: tuple[SchedulerOutput, ...]

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return [s for group in self.groups for s in group.scheduled]

    @property
    def is_empty(self) -> bool:
        return all(group.is_empty for group in self.groups)

    @property
    def preempted_request_ids(self) -> list[str]:
        return [r for group in self.groups for r in group.preempted_request_ids]

    @property
    def finished_request_ids(self) -> list[str]:
        return [r for group in self.groups for r in group.finished_request_ids]

    @property
    def prefix_cache_queries(self) -> int:
        return sum(group.prefix_cache_queries for group in self.groups)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(group.prefix_cache_hits for group in self.groups)

    @property
    def is_idle(self) -> bool:
        """Nothing to run and nothing to tell the runners: an executor may skip this plan."""
        return self.is_empty and not self.finished_request_ids


class DataParallelScheduler:
    """The engine's scheduler: the `Scheduler` interface over `num_groups` independent groups.

    `max_waiting` bounds the requests queued across all groups, as it would in one.
    """

    def __init__(
        self, config: SchedulerConfig, num_groups: int = 1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.config = config
        self._clock = clock
        self.admission = AdmissionTally()
        """How SLO admission's predictions turned out, every group's together."""
        self.groups = [Scheduler(replace(config, max_waiting=None), clock, self.admission) for _ in range(num_groups)]
        self._group_of: dict[str, int] = {}
        self._router = PrefixRouter(num_groups) if config.enable_prefix_caching and num_groups > 1 else None
        self.time_router = TimeRouter(num_groups) if config.dp_routing == "tokens" and num_groups > 1 else None
        """Each group's own step-time model, with `dp_routing="tokens"` and several groups."""

    def _least_loaded(self, request: Request) -> int:
        """With token routing, the group where `request`'s first token is projected to come
        soonest (see `load_routing`); else (and among equals) queued requests weigh more than
        running ones (they will all need a prefill), then KV blocks in use break ties, then the
        lowest group index."""

        def load(g: int) -> tuple[int, int, int]:
            return (self._load_score(g), self.groups[g].block_manager.num_used_blocks, g)

        if self.time_router is not None:

            def first_token_s(g: int, model: StepTimeModel) -> float:
                projection = self.groups[g].project_first_token(request, model)
                assert projection is not None, "the router asks only once every group's model is ready"
                return projection.wait_s

            return self.time_router.choose(first_token_s, lambda g: self.groups[g].backlog_tokens(), load)
        return min(range(len(self.groups)), key=load)

    def _load_score(self, group: int) -> int:
        """4 per queued request, 1 per running one (the score `prefix_routing` compares)."""
        return 4 * self.groups[group].num_waiting + self.groups[group].num_running

    def add_request(self, request: Request, slo_admission: bool = True, group: int | None = None) -> None:
        """As `Scheduler.add_request`; the request joins `group` when given (the start-up profile
        runs the same requests in every group), else the group holding the longest prefix of its
        prompt unless that group is much busier (see `prefix_routing`), else the least-loaded group."""
        max_waiting = self.config.max_waiting
        if max_waiting is not None and self.num_waiting >= max_waiting:
            raise QueueFullError(f"waiting queue is full ({max_waiting} requests)")
        if group is None:
            group, prompt_hashes = self._route(request)
        else:
            prompt_hashes = block_hashes(
                request, self.config.block_size, (request.num_tokens - 1) // self.config.block_size
            )
        self.groups[group].add_request(request, slo_admission)
        if self._router is not None:
            self._router.add(request.request_id, group, prompt_hashes)
        self._group_of[request.request_id] = group

    def _route(self, request: Request) -> tuple[int, list[bytes]]:
        """The group for a new request, and the hashes of its prompt's full blocks it was matched
        by: the least loaded group, or with prefix caching the one that holds the longest prefix
        of its prompt, unless that one is much busier."""
        least = self._least_loaded(request)
        if self._router is None:
            return least, []
        block_size = self.config.block_size
        hashes = block_hashes(request, block_size, (request.num_tokens - 1) // block_size)

        def cached_blocks(group: int) -> int:
            return len(self.groups[group].block_manager.lookup(request))

        loads = [self._load_score(g) for g in range(len(self.groups))]
        return self._router.choose(hashes, cached_blocks, loads, least), hashes

    def group_of(self, request_id: str) -> int | None:
        return self._group_of.get(request_id)

    def _owner(self, request_id: str) -> Scheduler | None:
        group = self._group_of.get(request_id)
        return None if group is None else self.groups[group]

    def abort_request(self, request_id: str) -> bool:
        owner = self._owner(request_id)
        if owner is None:
            return False
        self._forget(request_id)
        return owner.abort_request(request_id)

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> bool:
        owner = self._owner(request_id)
        if owner is None or not owner.finish_request(request_id, reason, stop_reason):
            return False
        self._forget(request_id)
        return True

    def finish_kv_load(self, request_id: str, loaded: bool) -> bool:
        """See `Scheduler.finish_kv_load`."""
        owner = self._owner(request_id)
        return owner is not None and owner.finish_kv_load(request_id, loaded)

    def _forget(self, request_id: str) -> None:
        del self._group_of[request_id]
        if self._router is not None:
            self._router.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.groups)

    def heal(self, lost: Collection[int]) -> int:
        """Go on without the groups `lost` (their ranks are gone) after the step in flight was
        lost. Every request of a lost group moves to a surviving group's queue, the least loaded
        at the time, keeping the tokens it has sampled, to recompute from prompt + outputs there;
        the surviving groups' requests are requeued for recompute in their own group
        (`Scheduler.lose_step`). Groups after a lost one are renumbered, as their ranks are.
        Returns how many requests moved."""
        survivors = [g for g in range(len(self.groups)) if g not in lost]
        if not survivors:
            raise ValueError("no data-parallel group is left")
        released = [r for g in sorted(lost) for r in self.groups[g].release_all()]
        for g in survivors:
            self.groups[g].lose_step()
        renumbered = {old: new for new, old in enumerate(survivors)}
        self.groups = [self.groups[g] for g in survivors]
        self._group_of = {rid: renumbered[g] for rid, g in self._group_of.items() if g in renumbered}
        loads = [self._load_score(g) for g in range(len(self.groups))]
        adopted: list[list[Request]] = [[] for _ in self.groups]
        for request in released:
            group = min(range(len(self.groups)), key=lambda g: (loads[g], g))
            loads[group] += 4  # as a queued request weighs in `_load_score`
            adopted[group].append(request)
            self._group_of[request.request_id] = group
        for scheduler, requests in zip(self.groups, adopted):
            scheduler.adopt(requests)
        if self._router is not None:
            self._router = self._router.regrouped(self._group_of, len(self.groups)) if len(self.groups) > 1 else None
        if self.time_router is not None:
            self.time_router = self.time_router.keeping(survivors) if len(self.groups) > 1 else None
        return len(released)

    def add_groups(self, count: int) -> None:
        """`count` new, empty groups after the others (returned ranks rejoined): new requests find
        them the least loaded; running requests stay where their KV is."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        first = len(self.groups)
        self.groups += [
            Scheduler(replace(self.config, max_waiting=None), self._clock, self.admission) for _ in range(count)
        ]
        if self.config.enable_prefix_caching:
            self._router = (self._router or PrefixRouter(first)).regrouped(self._group_of, len(self.groups))
        if self.config.dp_routing == "tokens":
            router = self.time_router or TimeRouter(first)
            self.time_router = router.growing(count)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.groups)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return sum(s.block_manager.num_used_blocks for s in self.groups)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of every group's cache together (with several block-table groups, every
        table group's pool: the blocks `num_used_blocks` counts from)."""
        return sum(s.block_manager.num_blocks for s in self.groups)

    @property
    def group_blocks(self) -> tuple[GroupBlocks, ...]:
        """Each block-table group's blocks held and pool, every data-parallel group's together
        (theirs are the same groups, in the same order)."""
        usage = [s.block_manager.group_blocks for s in self.groups]
        return tuple(
            GroupBlocks(mine.group, sum(u[i].used for u in usage), sum(u[i].total for u in usage))
            for i, mine in enumerate(usage[0])
        )

    @property
    def num_state_slots(self) -> tuple[int, int]:
        """(in use, in every group's cache) of the state slots of a model with state layers: one per
        running sequence, `max_num_seqs` per group; (0, 0) for a model without."""
        if not self.config.has_state:
            return 0, 0
        return self.num_running, self.config.max_num_seqs * len(self.groups)

    @property
    def num_saved_states(self) -> tuple[int, int]:
        """(findable, slots in every group's cache) of prefix caching's saved states."""
        saved = [s.block_manager.saved_states for s in self.groups]
        return sum(x.num_held for x in saved), sum(x.num_slots for x in saved)

    @property
    def step_time_models(self) -> list[StepTimeModel]:
        """Every model that prices steps here: each group's (slo chunk sizing, admission) and
        each group's in the token router. Until all are `ready` some choice is made blind."""
        models = [model for s in self.groups if (model := s.step_time_model) is not None]
        return models + (self.time_router.models if self.time_router is not None else [])

    def observe(self, plan: StepPlan, duration_s: float, group_durations_s: Sequence[float] | None = None) -> None:
        """A step of `plan` took `duration_s`: each group with work saw the whole lockstep step's
        time (the slowest group's), which its TBT targets are about. `group_durations_s`, when
        the executor can tell, is the time each group's ranks spent on their own share; the
        token router learns each group's speed from it (else from `duration_s`)."""
        if group_durations_s is not None and len(group_durations_s) != len(self.groups):
            raise ValueError(f"{len(group_durations_s)} group durations for {len(self.groups)} groups")
        for g, (scheduler, output) in enumerate(zip(self.groups, plan.groups)):
            scheduler.observe(output, duration_s)
            if self.time_router is not None and not output.is_empty:
                shape = StepShape.of((len(s.token_ids), s.start_position) for s in output.scheduled)
                self.time_router.observe(g, shape, duration_s if group_durations_s is None else group_durations_s[g])

    def schedule(self) -> StepPlan:
        return StepPlan(tuple(s.schedule() for s in self.groups))

    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: Mapping[str, int | Sequence[int]],
        duration_s: float | None = None,
        group_durations_s: Sequence[float] | None = None,
    ) -> list[Request]:
        """As `Scheduler.update` for every group, each taught the step's time (`observe`)."""
        if duration_s is not None:
            self.observe(plan, duration_s, group_durations_s)
        finished = [
            request
            for scheduler, output in zip(self.groups, plan.groups)
            for request in scheduler.update(output, sampled_token_ids)
        ]
        for request in finished:
            if request.request_id in self._group_of:
                self._forget(request.request_id)
        return finished
