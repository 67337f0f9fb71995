"""Per-rank body of `test_torch_dispatch_steps`: the `torch` backend's steps against its own
dispatch() and combine(), one pass at a time and two passes interleaved."""

from __future__ import annotations

import torch
from dispatch_cases import Case, modes, placement_for, rank_inputs, toy_experts

from moeserve.dispatch import create_dispatcher
from moeserve.dispatch.base import finish


def drive(steps) -> tuple[object, int]:
    """Run a `Steps` generator to the end: (its result, how many times it yielded)."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, yields
        yields += 1


def interleaved(first, second) -> tuple[object, object]:
    """Two `Steps` advanced in turn, as two-batch overlap drives them: both in flight at once."""
    results: list[object] = [None, None]
    pending = {0: first, 1: second}
    while pending:
        for i in list(pending):
            try:
                next(pending[i])
            except StopIteration as done:
                results[i] = done.value
                del pending[i]
    return results[0], results[1]


def run_steps(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """Per case and mode: dispatch()/combine() results, the steps' results and yield counts, and the
    results of two passes (this rank's tokens split in two halves) whose steps were interleaved."""
    torch.set_num_threads(1)
    out = []
    for case in cases:
        placement = placement_for(case, world_size, rank)
        dispatcher = create_dispatcher("torch", placement)
        hidden, ids, weights = rank_inputs(case, rank)
        per_mode = {}
        for mode, bound in modes(case):
            plain = dispatcher.dispatch(hidden, ids, weights, bound)
            plain_out = dispatcher.combine(toy_experts(case, plain, placement.local_experts), plain.handle)
            stepped, dispatch_yields = drive(dispatcher.dispatch_steps(hidden, ids, weights, bound))
            stepped_out, combine_yields = drive(
                dispatcher.combine_steps(toy_experts(case, stepped, placement.local_experts), stepped.handle)
            )
            half = hidden.shape[0] // 2
            parts = [(hidden[:half], ids[:half], weights[:half]), (hidden[half:], ids[half:], weights[half:])]
            received = interleaved(*(dispatcher.dispatch_steps(*p, bound) for p in parts))
            combined = interleaved(
                *(dispatcher.combine_steps(toy_experts(case, r, placement.local_experts), r.handle) for r in received)
            )
            per_mode[mode] = {
                "plain": (plain.hidden, plain.num_tokens_per_expert, plain.num_tokens_per_expert_host, plain_out),
                "stepped": (
                    stepped.hidden,
                    stepped.num_tokens_per_expert,
                    stepped.num_tokens_per_expert_host,
                    stepped_out,
                ),
                "yields": (dispatch_yields, combine_yields),
                "halves": torch.cat(combined),
                "halves_sequential": torch.cat(
                    [
                        finish(dispatcher.combine_steps(toy_experts(case, r, placement.local_experts), r.handle))
                        for r in (dispatcher.dispatch(*p, bound) for p in parts)
                    ]
                ),
            }
        out.append(per_mode)
    return out
