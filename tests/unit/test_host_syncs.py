"""No host sync inside the MoE layers at ep = 1: the whole engine generates (prefill and decode
steps) while every sync-making call is counted, and none may come from an MoE block's forward.

The multi-process (ep = 4, `torch` dispatcher) half is tests/distributed/test_host_syncs_ep.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.host_syncs import UPLOADS, HostSyncCounter

from moeserve import LLM, SamplingParams
from moeserve.models.layers.moe import MoEBlock

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def moe_blocks(llm: LLM) -> list[MoEBlock]:
    return [m for m in llm.engine.executor.model.modules() if isinstance(m, MoEBlock)]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def llm(request, make_checkpoint) -> LLM:
    return LLM(str(make_checkpoint(request.param, 3)), block_size=8, max_model_len=64)


def prompts() -> list[dict]:
    return [{"prompt_token_ids": [5, 9, 11, 7, 3]}, {"prompt_token_ids": [17, 4]}]


def test_no_host_sync_in_moe_layers(llm: LLM) -> None:
    blocks = moe_blocks(llm)
    assert blocks
    with HostSyncCounter(blocks) as syncs:
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert syncs.inside_moe == []
    # The counter counts: the runner's uploads and the sampler's reads happen outside the MoE layers.
    assert any(call.startswith("Tensor.tolist") for call in syncs.outside_moe)
    assert any(call.startswith(UPLOADS) for call in syncs.outside_moe)


def test_counter_catches_a_sync_inside_an_moe_layer(llm: LLM) -> None:
    """A `.tolist()` slipped into a router (inside the MoE block) is attributed to the MoE layer."""
    blocks = moe_blocks(llm)

    def read_ids(module, args, output) -> None:
        output[0].tolist()

    hook = blocks[0].router.register_forward_hook(read_ids)
    try:
        with HostSyncCounter(blocks) as syncs:
            llm.generate(prompts()[:1], GREEDY, use_tqdm=False)
    finally:
        hook.remove()
    assert syncs.inside_moe and all(call.startswith("Tensor.tolist") for call in syncs.inside_moe)


class RoutedTotals:
    """A stat logger summing the routed-token reports the engine hands out (about once a second)."""

    def __init__(self) -> None:
        self.per_layer: list[int] | None = None

    def record(self, stats) -> None:
        if stats.routed_tokens is not None:
            self.add(stats.routed_tokens.counts)

    def add(self, counts: list[list[int]]) -> None:
        totals = [sum(layer) for layer in counts]
        self.per_layer = totals if self.per_layer is None else [a + b for a, b in zip(self.per_layer, totals)]


def test_routed_tokens_are_read_once_per_report(llm: LLM) -> None:
    """The load counters stay on the device and add up to every routed pair: the engine's
    reports plus a final read cover each pair once, and a read resets the counters."""
    model = llm.engine.executor.model
    model.take_routed_tokens()  # start from zero
    totals = RoutedTotals()
    llm.engine.stat_loggers.append(totals)
    try:
        llm.generate(prompts(), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.stat_loggers.remove(totals)
    totals.add(model.take_routed_tokens())
    blocks = moe_blocks(llm)
    num_tokens = 5 + 2 + 2  # both prompts, then one decode step of both (the last token is not fed)
    assert totals.per_layer == [num_tokens * model.cfg.router.top_k] * len(blocks)
    assert all(block.routed_tokens.dtype == torch.int64 and not block.routed_tokens.any() for block in blocks)
