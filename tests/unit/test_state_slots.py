"""The runner's state slots: one per running sequence of a model with Gated DeltaNets, from its
first step to its finish or preemption; a sequence that would join a state midway is a bug."""

from __future__ import annotations

import pytest

from moeserve.scheduler import ScheduledRequest
from moeserve.worker.state_slots import StateSlots


def scheduled(request_id: str, start: int, num_tokens: int, drafts: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id, list(range(num_tokens)), start, [0], sample=True, num_draft_tokens=drafts)


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


def test_a_verify_step_is_followed_by_a_restore_to_the_last_kept_draft():
    """Verifying 3 drafts from position 10: the next start says how many were kept (12: one, so
    the state after token 1 of the verify step; 14: all, nothing to restore); a preempted
    sequence restores nothing."""
    slots = StateSlots(2)
    slots.batch([scheduled("a", 0, 10)])
    assert slots.batch([scheduled("a", 10, 4, drafts=3)]).drafts == (3,)
    assert slots.batch([scheduled("a", 12, 4, drafts=3)]).restores == (1,)
    assert slots.batch([scheduled("a", 16, 1)]).restores == (-1,)  # all 3 kept: the slot's own state
    slots.batch([scheduled("a", 17, 3, drafts=2)])
    slots.release(["a"])  # preempted
    assert slots.batch([scheduled("a", 0, 19)]).restores == (-1,)
    with pytest.raises(RuntimeError, match="resumes at 30 after verifying from 19"):
        slots.batch([scheduled("a", 19, 2, drafts=1)])
        slots.batch([scheduled("a", 30, 1)])
