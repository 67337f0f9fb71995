"""Scheduler test factories: requests with predictable tokens, a scheduler that remembers what it
was given, and the check every plan must pass."""

from __future__ import annotations

import random
from collections.abc import Callable

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

EOS = 0


def run_step(scheduler: RecordingScheduler, pool=None) -> SchedulerOutput:
    """Plan a step, check it, let a fake cache `pool` (with `run(scheduler, output)`) play it, and
    apply its sampled tokens (`token_for` the next position of each sampling request)."""
    output = scheduler.schedule()
    check_output(scheduler, output)
    if pool is not None:
        pool.run(scheduler, output)
    positions = {s.request_id: s.start_position + len(s.token_ids) for s in output.scheduled if s.sample}
    scheduler.update(output, {request_id: token_for(request_id, p) for request_id, p in positions.items()})
    return output


def shared_prefix_workload(
    scheduler: RecordingScheduler, rng: random.Random, step: Callable[[], SchedulerOutput]
) -> int:
    """Run `scheduler` (each step by `step`) through a random workload until it is idle: for 60
    steps, a new request half the time (one of three shared prefixes and up to 8 tokens more, up
    to 12 tokens out), an abort of any request one step in 20. Returns the prefix-cache hits."""
    prefixes = [[rng.randint(3, 300) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    hits = 0
    for index in range(400):
        if index < 60 and rng.random() < 0.5:
            tokens = rng.choice(prefixes) + [rng.randint(3, 300) for _ in range(rng.randint(0, 8))]
            params = SamplingParams(max_tokens=rng.randint(1, 12))
            scheduler.add_request(Request(f"r{index}", tokens, params, (EOS,), arrival_time=0.0))
        if rng.random() < 0.05 and scheduler.added:
            scheduler.abort_request(rng.choice(list(scheduler.added)))
        hits += step().prefix_cache_hits
        if index >= 60 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    return hits


class RecordingScheduler(Scheduler):
    """A `Scheduler` that remembers every request it accepted, by id, so a test can inspect
    requests it did not keep a name for (the scheduler itself lends none out)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.added: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.added[request.request_id] = request

    def is_live(self, request_id: str) -> bool:
        """Accepted and not finished: the scheduler still owns it."""
        request = self.added.get(request_id)
        return request is not None and not request.status.is_finished


def make_request(request_id: str, prompt_len: int = 4, max_tokens: int | None = 4, **params) -> Request:
    prompt = [100 + (sum(map(ord, request_id)) + i) % 50 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), (EOS,), arrival_time=0.0)


def token_for(request_id: str, position: int) -> int:
    """A deterministic non-EOS token, so a recomputed sequence must come out identical."""
    return 1 + (sum(map(ord, request_id)) * 31 + position) % 97


def check_output(scheduler: RecordingScheduler, output: SchedulerOutput) -> None:
    """The plan respects the limits, hands the runner consistent, sufficient block tables, and
    introduces exactly the requests it runs for the first time."""
    config = scheduler.config
    assert output.num_batched_tokens == sum(len(s.token_ids) for s in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
    if output.preempted_request_ids:  # no admission in a step that had to preempt
        assert all(s.start_position > 0 for s in output.scheduled)
    for s in output.scheduled:
        request = scheduler.added[s.request_id]
        assert request.status is RequestStatus.RUNNING
        assert s.token_ids and s.start_position == request.num_computed_tokens
        known = len(s.token_ids) - s.num_draft_tokens  # drafts follow the request's own tokens
        assert s.token_ids[:known] == request.all_token_ids[s.start_position : s.start_position + known]
        assert s.block_ids == request.block_ids
        assert len(s.block_ids) * config.block_size >= s.start_position + len(s.token_ids)
        assert s.sample == (s.start_position + known == request.num_tokens)
        assert not s.num_draft_tokens or (s.sample and known == 1)
    scheduled = {s.request_id for s in output.scheduled}
    for new in output.new_requests:
        request = scheduler.added[new.request_id]
        assert new.request_id in scheduled and request.num_preemptions == 0
        assert (new.sampling_params, new.prompt_token_ids) == (request.sampling_params, tuple(request.prompt_token_ids))
