"""Saved states for prefix caching of a model whose layers keep a state per sequence (Gated
DeltaNet): which saved-state slot holds the state after which prefix of full blocks.

A paged layer's cache of a prefix is its blocks; a state layer's is one state, valid only at the
position it was taken. So a prefix-cache hit of such a model resumes where a saved state exists:
the runner copies a sequence's states into a saved-state slot at the end of a step the scheduler
marked, and a later request whose tokens begin with that prefix starts from a copy of it (as
SGLang's radix cache for Mamba does). A saved state is addressed by the hash of its prefix's last
block (`block_hash`, chained over every earlier token), so it is found exactly when the blocks
are. Its own budget (`num_slots`, in the memory budget beside the running sequences' states) and
its own LRU order: a hit or a save makes a state the most recently used, a save with no slot free
evicts the least recently used.

A save becomes findable only once its step has run (`commit`, from `Scheduler.update`): the plan
names the slot, the runner writes it at the step's end. A step lost with a rank writes nothing,
and its reservations go back (`drop_pending`). The runner loads a plan's restores before its
forward and writes its saves after it, so a slot evicted for a save in the same plan as a restore
from it is read before it is overwritten.

Prefill/decode disaggregation moves a prompt's state as one of these: the prefill instance pins
the state saved at the prompt's mark (`pin`) until a decode instance's push has read it, and the
decode instance writes it into a slot reserved for the load (`reserve_load`), findable once the
load has ended well (`end_load`) beside the loaded blocks, so admission resumes from it as from
any prefix hit.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from moeserve.scheduler.block_hash import BlockHash, block_hashes
from moeserve.scheduler.request import Request


class SavedStates:
    """`num_slots` saved-state slots, each holding the state after one prefix of full blocks."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._slot_by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pending: dict[BlockHash, int] = {}  # saves the step in flight writes
        self._pins: Counter[int] = Counter()  # held slots a transfer reads: never evicted
        self._loading: dict[int, BlockHash] = {}  # slots a transfer writes into

    @property
    def num_held(self) -> int:
        """Saved states findable now."""
        return len(self._slot_by_hash)

    @property
    def num_pending(self) -> int:
        """Slots reserved for saves the step in flight writes."""
        return len(self._pending)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_by_hash

    def use(self, block_hash: BlockHash) -> int:
        """The slot holding the state after the prefix ending with `block_hash`, made the most
        recently used (a request resumes from it)."""
        self._slot_by_hash.move_to_end(block_hash)
        return self._slot_by_hash[block_hash]

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for the state after the prefix ending with `block_hash`, which the planned step
        computes; None when that state is already held or being saved (a held one becomes the most
        recently used), or when every slot is being written by this step."""
        if block_hash in self._slot_by_hash:
            self._slot_by_hash.move_to_end(block_hash)
            return None
        if block_hash in self._pending:
            return None
        slot = self._take_slot()
        if slot is not None:
            self._pending[block_hash] = slot
        return slot

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used held one that no transfer pins, else None."""
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slot_by_hash.items():
            if slot not in self._pins:
                del self._slot_by_hash[block_hash]
                return slot
        return None

    def pin(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after the prefix ending with `block_hash`, kept from eviction
        until `unpin` (a decode instance reads it), or None when no such state is held."""
        slot = self._slot_by_hash.get(block_hash)
        if slot is not None:
            self._pins[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    def reserve_load(self, block_hash: BlockHash) -> int | None:
        """A slot for a transfer to write the state after the prefix ending with `block_hash` into,
        or None when that state is held or saved already, or no slot can be taken."""
        if block_hash in self._slot_by_hash or block_hash in self._pending:
            return None
        slot = self._take_slot()
        if slot is not None:
            self._loading[slot] = block_hash
        return slot

    def end_load(self, slot: int, loaded: bool) -> None:
        """The transfer into `slot` has ended: loaded, its state is findable (unless a save of the
        same prefix got there first); otherwise the slot goes back unwritten."""
        block_hash = self._loading.pop(slot)
        if loaded and block_hash not in self._slot_by_hash and block_hash not in self._pending:
            self._slot_by_hash[block_hash] = slot
        else:
            self._free.append(slot)

    def commit(self) -> None:
        """The step in flight ran: its saves are findable."""
        self._slot_by_hash.update(self._pending)
        self._pending.clear()

    def drop_pending(self) -> None:
        """The step in flight was lost: its reserved slots go back unwritten."""
        self._free.extend(self._pending.values())
        self._pending.clear()


def reserve_load_slot(states: SavedStates, request: Request, block_size: int, num_blocks: int) -> int:
    """A slot of `states` for a transfer to write `request`'s state after its first `num_blocks`
    token blocks into (`SavedStates.reserve_load`), or -1 when none is taken."""
    if not num_blocks or not states.num_slots:
        return -1
    slot = states.reserve_load(block_hashes(request, block_size, num_blocks)[num_blocks - 1])
    return -1 if slot is None else slot
