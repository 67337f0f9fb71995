"""The runner's state slots: one per running sequence of a model with Gated DeltaNets, from its
first step to its finish or preemption; a sequence that would join a state midway is a bug."""

from __future__ import annotations

import pytest

from moeserve.scheduler import ScheduledRequest
from moeserve.worker.state_slots import StateSlots


def scheduled(request_id: str, start: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, list(range(num_tokens)), start, [0], sample=True)


def test_slots_follow_sequences_from_first_step_to_release():
    slots = StateSlots(3)
    first = slots.batch([scheduled("a", 0, 16), scheduled("b", 0, 5)])
    assert (first.slots, first.query_lens, first.resumes) == ((0, 1), (16, 5), (False, False))
    later = slots.batch([scheduled("b", 5, 1), scheduled("a", 16, 9), scheduled("c", 0, 2)])
    assert (later.slots, later.resumes) == ((1, 0, 2), (True, True, False))
    slots.release(["a", "ghost"])  # a finished; an id without a slot is skipped
    assert slots.num_free == 1 and sorted(slots.request_ids) == ["b", "c"]
    # Preempted "b" comes back from position 0 into whatever slot is free.
    slots.release(["b"])
    again = slots.batch([scheduled("b", 0, 6)])
    assert again.resumes == (False,) and slots.num_free == 1


def test_joining_a_state_midway_or_running_out_is_an_error():
    slots = StateSlots(1)
    with pytest.raises(RuntimeError, match="starts at position 7 without a state"):
        slots.batch([scheduled("late", 7, 1)])
    slots.batch([scheduled("a", 0, 3)])
    with pytest.raises(RuntimeError, match="all 1 state slots are taken"):
        slots.batch([scheduled("b", 0, 3)])
