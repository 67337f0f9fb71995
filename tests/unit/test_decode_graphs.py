"""Decode graphs on CPU through the emulating capture backend: the padding, the copy into the
persistent buffers, the pad rows' scratch slot and the slicing of the output, checked against
the eager engine. The CUDA half (real capture, bit-equal replay) is tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.host_syncs import HostSyncCounter

from moeserve import LLM, SamplingParams
from moeserve.engine_config import CudaGraphConfig, default_graph_sizes, parse_sizes
from moeserve.ops import TORCH_OPS, attention_batch
from moeserve.ops.attention import DecodeGraphInputs
from moeserve.ops.torch_attention import padded_context_len, padded_context_lens, paged_attention
from moeserve.scheduler import ScheduledRequest
from moeserve.worker.decode_graphs import DecodeGraphs, GraphSettings, create_decode_graphs, graph_refusal

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SIZES = (1, 3)


@pytest.fixture(scope="module")
def qwen3_folder(make_checkpoint):
    return make_checkpoint("qwen3_moe", 7, num_experts=6, num_experts_per_tok=2)


def prompts(n: int, seed: int, lo: int = 2, hi: int = 30) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(folder, graphs: bool, **kw) -> LLM:
    return LLM(str(folder), block_size=4, max_model_len=32, cuda_graph_sizes=SIZES, emulate_cuda_graphs=graphs, **kw)


def count_replays(monkeypatch) -> list[tuple[int, int]]:
    """(sequences, replayed size) of every replay from now on."""
    seen: list[tuple[int, int]] = []
    run = DecodeGraphs.run

    def counted(self, scheduled, size):
        seen.append((len(scheduled), size))
        return run(self, scheduled, size)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return seen


def test_graph_replays_give_the_eager_tokens_across_sizes_and_preemption(qwen3_folder, monkeypatch):
    """Four prompts with 3..12 tokens to go: decode steps of 4 sequences (above the largest size:
    eager), 3, 2 (padded to 3) and 1. A cache of 11 four-token blocks cannot hold all four
    contexts, so a sequence is preempted and recomputed."""
    batch = prompts(4, seed=1, lo=6, hi=14)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 6, 9, 12)]
    expected = token_ids(engine(qwen3_folder, False, kv_cache_blocks=11).generate(batch, params))
    replays = count_replays(monkeypatch)
    graphed = engine(qwen3_folder, True, kv_cache_blocks=11)
    schedule, preempted = graphed.engine.scheduler.schedule, []

    def spied():
        plan = schedule()
        preempted.extend(r for group in plan.groups for r in group.preempted_request_ids)
        return plan

    monkeypatch.setattr(graphed.engine.scheduler, "schedule", spied)
    assert token_ids(graphed.generate(batch, params)) == expected
    assert preempted
    assert {(n, size) for n, size in replays} == {(3, 3), (2, 3), (1, 1)}, replays
    assert graphed.engine.scheduler.num_used_blocks == 0
    # Alone, one by one: size 1 only, the same tokens.
    assert [token_ids(graphed.generate([p], q))[0] for p, q in zip(batch[:2], params)] == expected[:2]


def test_pad_rows_write_only_the_scratch_block_and_are_not_counted(qwen3_folder):
    llm = engine(qwen3_folder, True, kv_cache_blocks=40)
    executor = llm.engine.executor
    graphs = executor.runner.graphs
    assert graphs is not None and graphs.sizes == SIZES
    scratch = graphs.scratch_block
    assert scratch == 40 and executor.runner.kv_caches[0].shape[1] == 41  # [2, blocks + 1, ...]
    llm.generate(prompts(3, seed=6), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    executor.model.take_routed_tokens()
    for cache in executor.runner.kv_caches:
        cache[:, scratch] = 7.0  # so the pad row's write shows
    caches = [c.clone() for c in executor.runner.kv_caches]
    # Two decodes at positions 5 and 9 replay size 3: one pad row.
    scheduled = [ScheduledRequest("r0", [7], 5, [0, 1], True), ScheduledRequest("r1", [8], 9, [2, 3, 4], True)]
    hidden = graphs.run(scheduled, 3)
    assert hidden.shape == (2, executor.model.cfg.hidden_size)
    written = {1 * 4 + 1, 4 * 4 + 1, scratch * 4}
    for before, after in zip(caches, executor.runner.kv_caches):
        changed = (before != after).any(0).flatten(2).any(-1).flatten()  # [blocks * block_size] slots
        assert set(changed.nonzero().flatten().tolist()) == written
    routed = executor.model.take_routed_tokens()
    top_k = executor.model.cfg.router.top_k
    assert all(sum(layer) == 2 * top_k for layer in routed), routed  # the pad row is no load


def test_replay_makes_no_host_sync_and_equals_the_eager_padded_step(qwen3_folder):
    """Replayed at size 3, two decodes and a pad row give the bits of the same three rows run
    eagerly (the pad row as a sequence in the scratch block). Against the unpadded eager step
    only the tokens are promised: a GEMM's bits may depend on its row count."""
    llm = engine(qwen3_folder, True, kv_cache_blocks=40)
    runner = llm.engine.executor.runner
    model, graphs = runner.model, runner.graphs
    scheduled = [ScheduledRequest("a", [11], 6, [3, 4], True), ScheduledRequest("b", [12], 0, [9], True)]
    with HostSyncCounter(model.moe_blocks()) as syncs:
        graphs._write_pads(0, 3)  # noqa: SLF001 - the buffers as run() leaves them, uploads aside
        graphs._steps[3].replay()  # noqa: SLF001
    assert syncs.inside_moe == [] and syncs.outside_moe == []
    caches = [c.clone() for c in runner.kv_caches]
    replayed = graphs.run(scheduled, 3).clone()
    runner.kv_caches[:] = caches  # undo the replay's writes, then the same step eagerly
    tables = [s.block_ids for s in scheduled] + [[graphs.scratch_block]]
    batch = attention_batch(tables, [6, 0, 0], [1, 1, 1], 4)
    ids, positions = torch.tensor([11, 12, 0]), torch.tensor([6, 0, 0])
    eager = model(ids, positions, model.ops.plan_attention(batch), runner.kv_caches, 3)
    assert torch.equal(replayed, eager[:2])


def test_captured_torch_attention_is_bit_equal_to_eager_for_every_context():
    """The torch reference's captured plan (every grid length a bucket) against eager buckets."""
    torch.manual_seed(0)
    block_size, max_context, num_blocks = 4, 120, 80
    k_cache = torch.randn(num_blocks, block_size, 2, 8)
    v_cache = torch.randn(num_blocks, block_size, 2, 8)
    contexts = [1, 7, 32, 33, 48, 49, 97, 120]
    tables = [list(torch.randperm(num_blocks)[: -(-c // block_size)].tolist()) for c in contexts]
    q = torch.randn(len(contexts), 4, 8)
    eager_batch = attention_batch(tables, [c - 1 for c in contexts], [1] * len(contexts), block_size)
    eager = paged_attention(q, k_cache, v_cache, TORCH_OPS.plan_attention(eager_batch), 0.3, None)
    width = -(-max_context // block_size)
    inputs = DecodeGraphInputs(
        slot_mapping=eager_batch.slot_mapping,
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start=torch.arange(len(contexts) + 1, dtype=torch.int32),
        block_size=block_size,
        max_context_len=max_context,
    )
    captured = paged_attention(q, k_cache, v_cache, TORCH_OPS.decode_graph_planner(inputs)(), 0.3, None)
    assert torch.equal(captured, eager)
    assert padded_context_lens(120) == tuple(sorted({padded_context_len(c) for c in range(1, 121)}))


def test_graphs_are_off_on_cpu_and_with_enforce_eager(qwen3_folder, caplog):
    caplog.set_level(logging.INFO, logger="moeserve.worker.decode_graphs")
    assert LLM(str(qwen3_folder), max_model_len=64).engine.executor.runner.graphs is None
    llm = LLM(str(qwen3_folder), max_model_len=64, emulate_cuda_graphs=True, enforce_eager=True)
    assert llm.engine.executor.runner.graphs is None
    model, caches = llm.engine.executor.model, llm.engine.executor.runner.kv_caches
    settings = GraphSettings("cpu", 8, 64, two_batch_overlap=True)
    assert create_decode_graphs(model, caches, 16, 0, CudaGraphConfig(emulate=True), settings) is None
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "--enforce-eager" in messages and "two-batch overlap" in messages
    assert "CUDA devices only" in graph_refusal(CudaGraphConfig(), torch.device("cpu"), settings)


def test_graph_sizes_option():
    assert default_graph_sizes(256)[:6] == (1, 2, 4, 8, 16, 24) and default_graph_sizes(256)[-1] == 256
    assert default_graph_sizes(1000)[-1] == 512 and default_graph_sizes(12) == (1, 2, 4, 8, 12)
    assert parse_sizes("8, 1,2") == (8, 1, 2) and CudaGraphConfig(sizes=(8, 1, 2, 2)).sizes == (1, 2, 8)
    assert CudaGraphConfig(sizes=(1, 64)).capture_sizes(32) == (1,)
    for bad in ("", "1,x", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="positive"):
        CudaGraphConfig(sizes=(0, 4))
