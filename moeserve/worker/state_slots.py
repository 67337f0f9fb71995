"""Which state slot each running sequence of a model with state layers (Gated DeltaNet) holds.

A sequence takes a slot the first step it is scheduled and gives it back when it finishes or is
preempted (it then recomputes from position 0, into whatever slot is free on readmission). The
scheduler never runs more than `max_num_seqs` sequences, the slots the cache holds, so a slot is
always free for a newcomer; running out is a bug and is reported as one.

Drafts: a step that verifies k drafts leaves the state after all 1 + k tokens in the slot, and
the states after each of them beside it. How many were accepted is known on every rank at the
next step, with no message: the sequence starts after its last computed token, so
`start - (previous start + 1)` drafts were kept; fewer than k, and the step begins by restoring
the state after the last kept one.

Prefix caching: a sequence whose hit starts it from a saved state (`load_state`) takes a slot at
a later position; the runner copies the saved state into it before the step's forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from moeserve.ops.state_batch import StateBatch
from moeserve.scheduler import ScheduledRequest


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._slot_of: dict[str, int] = {}
        self._verified: dict[str, tuple[int, int]] = {}  # sequences that verified drafts: (start, drafts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def request_ids(self) -> list[str]:
        """The sequences holding a slot."""
        return list(self._slot_of)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the slots of these sequences (finished or preempted); ids without one are skipped."""
        for request_id in request_ids:
            self._verified.pop(request_id, None)
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def batch(self, scheduled: Sequence[ScheduledRequest]) -> StateBatch:
        """The step's `StateBatch`, slots taken for sequences scheduled for the first time (which
        start at position 0 or from a saved state: a state cannot be joined midway)."""
        slots, restores = [], []
        for s in scheduled:
            restores.append(self._restore(s))
            if s.num_draft_tokens:
                self._verified[s.request_id] = (s.start_position, s.num_draft_tokens)
            slot = self._slot_of.get(s.request_id)
            if slot is None:
                if s.start_position and s.load_state < 0:
                    raise RuntimeError(
                        f"request {s.request_id!r} starts at position {s.start_position} without a state"
                    )
                if not self._free:
                    raise RuntimeError(
                        f"all {self.num_slots} state slots are taken (more running sequences than slots)"
                    )
                slot = self._slot_of[s.request_id] = self._free.pop()
            slots.append(slot)
        return StateBatch(
            tuple(slots),
            tuple(len(s.token_ids) for s in scheduled),
            tuple(s.start_position > 0 for s in scheduled),
            tuple(s.num_draft_tokens for s in scheduled),
            tuple(restores),
        )

    def slot(self, request_id: str) -> int:
        """The slot `request_id` holds."""
        return self._slot_of[request_id]

    def _restore(self, s: ScheduledRequest) -> int:
        """The kept state `s` continues from, or -1 (it verified nothing last, or kept every draft)."""
        verified = self._verified.pop(s.request_id, None)
        if verified is None or not s.start_position:
            return -1
        start, num_drafts = verified
        kept = s.start_position - start - 1
        if not 0 <= kept <= num_drafts:
            raise RuntimeError(f"request {s.request_id!r} resumes at {s.start_position} after verifying from {start}")
        return kept if kept < num_drafts else -1
