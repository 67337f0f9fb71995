"""Two-batch overlap's pieces: the split of a step's sequences, the micro-batch bounds, the
round-robin interleave of two passes, and an MoE block's steps on the `local` dispatcher."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch.base import finish
from moeserve.models import TensorParallel
from moeserve.worker.two_batch import interleave, micro_batch_bounds, micro_batch_tokens, split_point


@pytest.mark.parametrize(
    "query_lens,cut",
    [
        ((), 0),  # nothing scheduled: both micro-batches empty
        ((9,), 1),  # one sequence: all in the first, the second empty
        ((1, 1), 1),
        ((1, 1, 1, 500), 3),  # whole sequences only: the long prefill stays in one piece
        ((10, 1, 1, 10), 2),
        ((3, 3, 3, 3), 2),
        ((4, 2, 2), 1),  # 4 | 4
        ((2, 4, 2), 1),  # 2 | 6 and 6 | 2 tie: the earlier cut
        ((50, 1), 1),  # two sequences: never an empty micro-batch
    ],
)
def test_split_point_halves_the_tokens_by_whole_sequences(query_lens, cut) -> None:
    assert split_point(query_lens) == cut
    first, second = micro_batch_tokens(query_lens)
    assert (first, second) == (sum(query_lens[:cut]), sum(query_lens[cut:]))


def test_micro_batch_bounds_cover_every_group_and_tensor_parallel_slice() -> None:
    steps = [(5, 1, 1, 5), (9,), ()]  # three data-parallel groups: 6 | 6, 9 | 0, 0 | 0
    assert micro_batch_bounds(steps, TensorParallel()) == (9, 6)
    tp2 = TensorParallel(rank=1, size=2, group=object())  # only its size matters here
    assert micro_batch_bounds(steps, tp2) == (5, 3)  # ceil(9 / 2), ceil(6 / 2): the first slice's rows
    assert micro_batch_bounds([], TensorParallel()) == (0, 0)


def _pass(name: str, yields: int, log: list[str]):
    for i in range(yields):
        log.append(f"{name}{i}")
        yield
    log.append(f"{name}-done")
    return name.upper()


def test_interleave_takes_turns_in_a_fixed_order() -> None:
    log: list[str] = []
    assert interleave([_pass("a", 3, log), _pass("b", 1, log)]) == ["A", "B"]
    assert log == ["a0", "b0", "a1", "b-done", "a2", "a-done"]
    log.clear()
    assert interleave([_pass("a", 0, log), _pass("b", 2, log)]) == ["A", "B"]
    assert log == ["a-done", "b0", "b1", "b-done"]
    assert interleave([]) == []


def test_moe_block_steps_equal_its_forward_and_yield_at_dispatch_and_combine(make_checkpoint) -> None:
    from moeserve.models import load_model
    from moeserve.models.layers.moe import MoEBlock

    model = load_model(str(make_checkpoint("qwen2_moe", 5)), torch.float32, "cpu")
    block = next(m for m in model.modules() if isinstance(m, MoEBlock))
    x = torch.randn(6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    steps, yields = block.forward_steps(x), 0
    while True:  # the local dispatcher never waits, yet the block yields once at each
        try:
            next(steps)
        except StopIteration as done:
            out = done.value
            break
        yields += 1
    assert yields == 2
    assert torch.equal(out, block(x))
    assert torch.equal(finish(block.forward_steps(x[:0])), block(x[:0]))  # an empty micro-batch
