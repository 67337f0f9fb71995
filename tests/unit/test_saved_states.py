"""Prefix caching for a model whose layers keep a state per sequence (Gated DeltaNet): saved
states with their own slots and LRU order, steps cut and marked where a state is saved, hits
only where one exists, and a random workload run against a fake state pool that checks every
state a step starts from is the one its own tokens would have left."""

from __future__ import annotations

import random

import pytest
from helpers.clock import TickingClock
from helpers.scheduler import EOS, RecordingScheduler, run_step, shared_prefix_workload

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, RequestStatus, SchedulerConfig, SchedulerOutput
from moeserve.scheduler.saved_states import SavedStates


def make_scheduler(**overrides) -> RecordingScheduler:
    fields = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        has_state=True,
        num_saved_states=4,
        state_save_interval=4,
    )
    return RecordingScheduler(SchedulerConfig(**(fields | overrides)), clock=TickingClock())


def make_request(request_id: str, tokens: list[int], max_tokens: int = 3) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


class FakeStates:
    """A runner's state slots as the tokens each state has consumed: a running sequence's state,
    and each saved slot's. A step starts a sequence from zeros (position 0), from a saved state
    (`load_state`) or from its own; every one must hold exactly the tokens before its start."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[int, ...]] = {}
        self.saved: dict[int, tuple[int, ...]] = {}

    def run(self, scheduler: RecordingScheduler, output: SchedulerOutput) -> None:
        for request_id in (*output.finished_request_ids, *output.preempted_request_ids):
            self.running.pop(request_id, None)
        for s in output.scheduled:  # loads before the forward, as the runner does
            tokens = tuple(scheduler.added[s.request_id].all_token_ids)
            if s.load_state >= 0:
                assert s.request_id not in self.running and s.start_position > 0
                self.running[s.request_id] = self.saved[s.load_state]
            state = self.running.get(s.request_id, ()) if s.start_position else ()
            assert state == tokens[: s.start_position], f"{s.request_id} starts from another state"
        for s in output.scheduled:  # the forward, then the saves
            tokens = tuple(scheduler.added[s.request_id].all_token_ids)
            end = s.start_position + len(s.token_ids) - s.num_draft_tokens
            self.running[s.request_id] = tokens[:end]
            if s.save_state >= 0:
                assert end % scheduler.config.block_size == 0 and not s.num_draft_tokens
                self.saved[s.save_state] = tokens[:end]


def step(scheduler: RecordingScheduler, states: FakeStates | None = None) -> SchedulerOutput:
    """A step run to its end: no saved state is left reserved."""
    output = run_step(scheduler, states)
    assert scheduler.block_manager.saved_states.num_pending == 0
    return output


def test_saved_states_keep_their_own_lru_order_and_commit_only_steps_that_ran():
    saved = SavedStates(2)
    assert saved.reserve(b"a") == 0 and saved.reserve(b"a") is None  # one save per prefix
    assert b"a" not in saved  # not findable before its step ran
    saved.commit()
    assert saved.reserve(b"b") == 1
    saved.commit()
    assert saved.use(b"a") == 0  # a hit: b is now the least recently used
    assert saved.reserve(b"c") == 1 and b"b" not in saved
    assert saved.reserve(b"d") == 0 and saved.reserve(b"e") is None  # every slot is being written
    saved.drop_pending()  # the step was lost: its slots go back unwritten
    assert saved.num_held == 0 and b"c" not in saved and sorted([saved.reserve(b"f"), saved.reserve(b"g")]) == [0, 1]


def test_transfers_pin_the_states_they_read_and_reserve_the_ones_they_write():
    saved = SavedStates(2)
    saved.reserve(b"a")
    saved.commit()
    assert saved.pin(b"a") == 0 and saved.pin(b"x") is None
    assert saved.reserve_load(b"a") is None  # held already: nothing to write
    assert saved.reserve_load(b"b") == 1  # the one free slot; a pinned one is never evicted
    assert saved.reserve(b"c") is None and saved.reserve_load(b"d") is None
    saved.end_load(1, loaded=True)
    assert b"b" in saved and saved.num_held == 2
    saved.unpin(0)
    assert saved.reserve_load(b"e") == 0 and b"a" not in saved  # unpinned: least recently used goes
    saved.end_load(0, loaded=False)  # the push failed: nothing findable, the slot goes back
    assert b"e" not in saved and saved.reserve(b"f") == 0


def test_a_prompt_is_cut_where_its_state_is_saved_and_a_repeat_resumes_there():
    """Block 4, interval 4 blocks (16 tokens): a 26-token prompt runs 16 (saved), then 8 to its
    last boundary before its last token (saved), then its last 2. The same prompt later resumes
    at 24 from the second save; one diverging at token 20 resumes at 16; blocks cached past a
    saved state are not a hit."""
    scheduler = make_scheduler()
    prompt = list(range(10, 36))
    scheduler.add_request(make_request("first", prompt))
    chunks = [step(scheduler).scheduled[0] for _ in range(3)]
    assert [(s.start_position, len(s.token_ids)) for s in chunks] == [(0, 16), (16, 8), (24, 2)]
    assert [s.save_state >= 0 for s in chunks] == [True, True, False]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    scheduler.add_request(make_request("repeat", prompt))
    scheduler.add_request(make_request("diverging", prompt[:20] + [99] * 8))
    output = step(scheduler)
    starts = {s.request_id: (s.start_position, s.load_state) for s in output.scheduled}
    assert starts == {"repeat": (24, chunks[1].save_state), "diverging": (16, chunks[0].save_state)}
    assert output.prefix_cache_hits == 24 + 16


def test_without_saved_state_slots_a_model_with_states_never_hits():
    scheduler = make_scheduler(num_saved_states=0)
    prompt = list(range(10, 36))
    for request_id in ("first", "again"):
        scheduler.add_request(make_request(request_id, prompt))
        output = step(scheduler)
        assert output.scheduled[0].start_position == 0 and output.scheduled[0].save_state == -1
        while scheduler.has_unfinished_requests():
            step(scheduler)


def test_a_lost_step_writes_no_saved_state():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", list(range(10, 36))))
    assert scheduler.schedule().scheduled[0].save_state >= 0
    scheduler.lose_step()
    assert scheduler.block_manager.saved_states.num_pending == 0
    assert scheduler.block_manager.saved_states.num_held == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_starts_every_sequence_from_its_own_prefix_state(seed):
    """Shared prefixes, a tight pool (preemption, eviction), few saved slots (their eviction),
    aborts and drafts-free decodes over save boundaries: every step starts each sequence from the
    state of exactly its own tokens before it, hits happen, and nothing leaks."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_model_len = 48
    scheduler = make_scheduler(
        max_num_seqs=rng.randint(2, 5),
        max_num_batched_tokens=rng.randint(8, 40),
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(1, 2) * max_model_len // block_size,
        num_saved_states=rng.randint(1, 6),
        state_save_interval=rng.randint(1, 6),
        policy=rng.choice(["fcfs", "slo"]),
    )
    states = FakeStates()
    assert shared_prefix_workload(scheduler, rng, lambda: step(scheduler, states)) > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    saved = scheduler.block_manager.saved_states
    assert saved.num_held <= saved.num_slots
    assert all(r.status is not RequestStatus.RUNNING for r in scheduler.added.values())
