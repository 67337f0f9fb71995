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


COMM_KERNELS = {"dispatch_send", "wait_signals", "dispatch_recv", "combine_send", "combine_reduce", "give_credit"}


def test_two_batch_overlap_puts_each_micro_batchs_comm_beside_the_others_compute(make_checkpoint) -> None:
    """Two micro-batches through two MoE layers on the nvshmem backend (one emulated PE), the
    streams recorded: each micro-batch's comm kernels go to a comm stream of its own, its
    router and experts to the compute stream, every data dependency between the streams is an
    event, and nothing else orders one micro-batch's comm behind the other's compute."""
    from moeserve.dispatch import DispatchRows, ExpertPlacement, NvshmemDispatcher
    from moeserve.dispatch.streams import CpuStreams
    from moeserve.dispatch.symmetric import EmulatedWorld
    from moeserve.models import load_model
    from moeserve.models.layers.moe import MoEBlock

    model = load_model(str(make_checkpoint("qwen2_moe", 5)), torch.float32, "cpu")
    block = next(m for m in model.modules() if isinstance(m, MoEBlock))
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, model.cfg.hidden_size, generator=g), torch.randn(2, model.cfg.hidden_size, generator=g)]
    want = [block(block(x)) for x in inputs]  # the local dispatcher, one pass at a time

    streams = CpuStreams(recording=True)
    block.dispatcher = NvshmemDispatcher(
        ExpertPlacement.contiguous(model.cfg.num_experts),
        DispatchRows(model.cfg.hidden_size, model.cfg.router.top_k, torch.float32),
        heap=EmulatedWorld(1).heaps[0],
        chunk_tokens=4,
        streams=streams,
    )
    block.router.register_forward_pre_hook(lambda *_: streams.note("router"))
    block.experts.register_forward_pre_hook(lambda *_: streams.note("experts"))

    def two_layers(x: torch.Tensor):
        hidden = yield from block.forward_steps(x, 3)  # low-latency: one chunk, no host read
        return (yield from block.forward_steps(hidden, 3))

    got = interleave([two_layers(x) for x in inputs], streams)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same bits as local, unsplit

    ops = list(enumerate(streams.ops))
    named = [(i, op) for i, op in ops if op.kind == "enqueue" and not op.what.startswith("micro-batch")]
    by_batch = {b: [(i, op) for i, op in named if op.scope[0] == f"micro-batch {b}"] for b in (0, 1)}
    for b, batch_ops in by_batch.items():
        for _, op in batch_ops:
            assert op.stream == (f"comm {b}" if op.what in COMM_KERNELS else "compute"), op
        whats = [op.what for _, op in batch_ops]
        layer = ["router", "dispatch_send", "wait_signals", "dispatch_recv", "experts", "combine_send",
                 "wait_signals", "combine_reduce", "give_credit"]  # fmt: skip
        assert whats == layer + layer

    def first(b: int, what: str, nth: int = 0) -> int:
        return [i for i, op in by_batch[b] if op.what == what][nth]

    before = streams.happens_before
    for b in (0, 1):  # every dependency across the streams holds, through events
        for layer in (0, 1):
            assert before(first(b, "router", layer), first(b, "dispatch_send", layer))
            assert before(first(b, "dispatch_recv", layer), first(b, "experts", layer))
            assert before(first(b, "experts", layer), first(b, "combine_send", layer))
        assert before(first(b, "combine_reduce", 0), first(b, "router", 1))
    cross = [op for _, op in ops if op.kind == "wait"]
    assert cross and all(op.stream != streams.ops[_recorded(streams, op.event)].stream for op in cross)

    def concurrent(a: int, b: int) -> bool:
        return not before(a, b) and not before(b, a)

    for layer in (0, 1):  # one micro-batch's comm may run while the other computes
        assert concurrent(first(0, "dispatch_send", layer), first(1, "router", layer))
        assert concurrent(first(0, "combine_send", layer), first(1, "experts", layer))
        assert concurrent(first(1, "dispatch_recv", layer), first(0, "experts", layer))
    assert concurrent(first(1, "combine_send", 0), first(0, "router", 1))


def _recorded(streams, event: int) -> int:
    return next(i for i, op in enumerate(streams.ops) if op.kind == "record" and op.event == event)
