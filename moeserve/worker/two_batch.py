"""Two-batch overlap: a step's sequences as two micro-batches whose passes through the model take
turns, so one micro-batch's MoE communication is in flight while the other computes.

Each micro-batch's pass is a generator (`MoECausalLM.forward_steps`) that yields wherever a
dispatch or combine waits for peers. `interleave` advances the passes in turn, A then B then A
..., each to its next yield: A issues its dispatch and yields, B computes its attention and
router and issues its own, A waits for its rows (long since arrived, if B took as long) and
computes its experts, and so on through every layer.

Collectives are matched across ranks by the order in which they are called, so every rank must
call them in the same order. That holds when (1) every rank runs two micro-batches whenever any
does, (2) the turns are taken in a fixed order, and (3) each pass yields equally often on every
rank. (1) is why the split decision uses only what every rank knows (the flag): a rank with one
sequence, or none, runs an empty second micro-batch (T = 0), which still joins every collective.
(2) is `interleave`'s fixed round robin. (3) holds because a pass yields at each dispatch and
combine a number of times fixed by the model and by the dispatcher's mode, which the step bound
decides alike everywhere (a dispatcher's steps must not yield a data-dependent number of times).

Streams: the overlap is real on a GPU only because each micro-batch's dispatch and combine
kernels go to the dispatcher's comm stream (`NvshmemDispatcher`) while the turns themselves
enqueue attention, router and experts on the compute stream. A's send is queued on the comm
stream, then B's attention on the compute stream: the GPU runs them side by side, and the
streams meet only where A's experts read A's received rows (an event recorded after the
receive). `interleave` takes each turn on the compute stream under the micro-batch's name, so
a recording backend (`CpuStreams`) tells the two micro-batches' operations apart.

Micro-batches are whole sequences, so each has an attention plan of its own and the torch
reference's attention, per sequence, gives the same rows as unsplit. Tensor parallelism splits
each micro-batch's tokens over the group as it would a whole step: the ranks of a group run the
same plan, so they split alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from moeserve.dispatch.base import Steps
from moeserve.dispatch.streams import Streams
from moeserve.models import TensorParallel

T = TypeVar("T")


def split_point(query_lens: Sequence[int]) -> int:
    """Where to cut the step's sequences (given by their token counts, in order) into two
    micro-batches `[:cut]` and `[cut:]` with about half the tokens each.

    With two or more sequences both micro-batches get at least one (the cut nearest half the
    tokens, the earlier on a tie); with one sequence it is all of the first micro-batch's, with
    none both are empty.
    """
    n = len(query_lens)
    if n < 2:
        return n
    total, prefix = sum(query_lens), 0
    best, best_gap = 1, None
    for cut in range(1, n):
        prefix += query_lens[cut - 1]
        gap = abs(2 * prefix - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = cut, gap
    return best


def micro_batch_tokens(query_lens: Sequence[int]) -> tuple[int, int]:
    """Tokens in each micro-batch of a step whose sequences have these token counts."""
    cut = split_point(query_lens)
    first = sum(query_lens[:cut])
    return first, sum(query_lens) - first


def micro_batch_bounds(steps_query_lens: Sequence[Sequence[int]], tp: TensorParallel) -> tuple[int, int]:
    """Per micro-batch, the most tokens any rank dispatches for it, given every data-parallel
    group's step (its sequences' token counts): what every rank knows from the plans, so all
    agree on the bounds without communicating. Tighter than the step's own bound, so a
    fixed-size wire format sends about what the unsplit step would, not twice as much."""
    sizes = [micro_batch_tokens(lens) for lens in steps_query_lens]
    return (
        max((tp.largest_slice(first) for first, _ in sizes), default=0),
        max((tp.largest_slice(second) for _, second in sizes), default=0),
    )


def interleave(passes: Sequence[Steps[T]], streams: Streams | None = None) -> list[T]:
    """Advance each pass to its next yield in turn (0, 1, 0, 1, ...; a pass that has returned is
    skipped) until all have returned; their results, in the passes' order.

    streams: each turn is enqueued on the stream current at the call (the compute stream) as
    `micro-batch i`; None: on whatever stream is current, unnamed."""
    results: list[T | None] = [None] * len(passes)
    running = list(range(len(passes)))
    compute = streams.current() if streams is not None else None
    while running:
        for i in list(running):
            try:
                if streams is None:
                    next(passes[i])
                else:
                    with streams.on(compute, f"micro-batch {i}"):
                        next(passes[i])
            except StopIteration as done:
                results[i] = done.value
                running.remove(i)
    return results  # type: ignore[return-value]
