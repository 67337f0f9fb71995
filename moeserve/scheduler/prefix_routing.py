"""Prefix-aware placement of requests on data-parallel attention groups.

Each group has its own KV cache, so a prefix cached in one group helps only requests placed
there. A new request goes to the group holding the longest prefix of its prompt, counting both
the blocks that group's cache holds and the prompts of the requests already placed there, whose
prefixes will be cached by the time a follower is admitted (a burst of requests sharing a system
prompt lands together, not one per group). Groups much busier than the least loaded one
(`is_much_busier`) are passed over: in a burst, the next group then starts its own copy of the
prefix, which it computes in parallel with the others' work (each group has its own ranks), so
spreading costs a prefill per group while piling up would cost every request a longer queue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from moeserve.scheduler.block_hash import BlockHash

BUSY_SLACK = 8
"""Load a group with the prefix may carry over twice the least loaded group's (in the load score
of `DataParallelScheduler`: 4 per queued request, 1 per running one): two queued requests or
eight running ones. On an idle server a prefix's first three requests stay together."""


def is_much_busier(load: int, least_load: int) -> bool:
    """Whether a group of load score `load` is too busy to take a request for its cached prefix,
    given the least loaded group's `least_load`: more than twice as loaded plus `BUSY_SLACK`."""
    return load > 2 * least_load + BUSY_SLACK


class PrefixRouter:
    """The prompt blocks of the live requests placed in each group, to match newcomers against.

    Counts, per group, how many live requests' prompts hold each block hash; a request's hashes
    leave when it finishes, when its computed blocks are in the group's cache for `cached_match`
    to see.
    """

    def __init__(self, num_groups: int) -> None:
        self._pending: list[Counter[BlockHash]] = [Counter() for _ in range(num_groups)]
        self._placed: dict[str, tuple[int, tuple[BlockHash, ...]]] = {}

    def add(self, request_id: str, group: int, hashes: Sequence[BlockHash]) -> None:
        self._placed[request_id] = (group, tuple(hashes))
        self._pending[group].update(hashes)

    def regrouped(self, group_of: Mapping[str, int], num_groups: int) -> PrefixRouter:
        """This router's placements over `num_groups` groups after a regrouping (a lost group's
        requests moved elsewhere, the groups after it renumbered): each request in `group_of` keeps
        its prompt's hashes under its new group; the others are dropped."""
        router = PrefixRouter(num_groups)
        for request_id, (_, hashes) in self._placed.items():
            if request_id in group_of:
                router.add(request_id, group_of[request_id], hashes)
        return router

    def remove(self, request_id: str) -> None:
        """Forget a finished request; unknown ids are ignored."""
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        group, hashes = placed
        pending = self._pending[group]
        pending.subtract(hashes)
        for block_hash in hashes:
            if pending[block_hash] <= 0:
                del pending[block_hash]

    def choose(
        self,
        hashes: Sequence[BlockHash],
        cached_blocks: Callable[[int], int],
        loads: Sequence[int],
        least: int,
    ) -> int:
        """The group for a request whose prompt's full blocks hash to `hashes`.

        `cached_blocks(g)`: how many of those blocks group g's cache holds as a prefix; `loads[g]`:
        group g's load score (lower is less busy); `least`: the least loaded group, by the
        caller's tie-breaks. Of the groups not much busier than `least`, the one with the longest
        matching prefix wins, the less loaded among equals; `least` when none matches at all.
        """
        if not hashes:
            return least
        best, best_key = least, (0, 0)
        for group, load in enumerate(loads):
            if is_much_busier(load, loads[least]):
                continue
            match = max(cached_blocks(group), self._pending_match(group, hashes))
            key = (match, -load)
            if match and key > best_key:
                best, best_key = group, key
        return best

    def _pending_match(self, group: int, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` that a live request placed in `group` also has (a hash
        covers every token before it, so one present hash means its whole prefix matches)."""
        pending = self._pending[group]
        count = 0
        for block_hash in hashes:
            if block_hash not in pending:
                break
            count += 1
        return count
