"""Real CUDA-graph replay of decode steps: bit-equal to the same padded step run eagerly, greedy
tokens equal to an --enforce-eager engine, capture time and memory logged. The logic around
capture is checked on CPU in tests/unit/test_decode_graphs.py."""

from __future__ import annotations

import logging

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.ops import attention_batch
from moeserve.scheduler import ScheduledRequest

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_folder(make_checkpoint):
    return make_checkpoint("qwen3_moe", 7, num_experts=6, num_experts_per_tok=2)


def engine(folder, kernels: str, dtype: str = "bfloat16", **kw) -> LLM:
    return LLM(
        str(folder), device="cuda", dtype=dtype, kernels=kernels, block_size=16, max_model_len=128,
        cuda_graph_sizes=(1, 2, 4), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_replay_is_bit_equal_to_the_eager_padded_step(qwen3_folder, kernels, caplog):
    caplog.set_level(logging.INFO, logger="moeserve.worker.decode_graphs")
    llm = engine(qwen3_folder, kernels)
    runner = llm.engine.executor.runner
    graphs, model = runner.graphs, runner.model
    assert graphs is not None and graphs.backend.name == "cuda"
    assert any("decode graphs (cuda)" in r.getMessage() and "MiB" in r.getMessage() for r in caplog.records)
    scheduled = [
        ScheduledRequest("a", [11], 40, [3, 4, 5], True),
        ScheduledRequest("b", [12], 0, [9], True),
        ScheduledRequest("c", [13], 17, [1, 2], True),
    ]
    caches = [c.clone() for c in runner.kv_caches]
    replayed = graphs.run(scheduled, 4).clone()  # one pad row
    for cache, saved in zip(runner.kv_caches, caches):
        cache.copy_(saved)
    tables = [s.block_ids for s in scheduled] + [[graphs.scratch_block]]
    batch = attention_batch(tables, [40, 0, 17, 0], [1] * 4, 16, "cuda")
    ids = torch.tensor([11, 12, 13, 0], device="cuda")
    positions = torch.tensor([40, 0, 17, 0], device="cuda")
    with torch.inference_mode():
        eager = model(ids, positions, model.ops.plan_attention(batch), runner.kv_caches, 4)
    assert torch.equal(replayed, eager[:3])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graphs_give_the_eager_engines_greedy_tokens(qwen3_folder, kernels):
    """In float32: padding changes GEMM row counts, so rows may differ from the unpadded eager
    step in the last bits; greedy tokens must not."""
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (5, 17, 33, 9, 24)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 5, 8, 11, 14)]
    eager = engine(qwen3_folder, kernels, "float32", enforce_eager=True)
    assert eager.engine.executor.runner.graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = engine(qwen3_folder, kernels, "float32")
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == expected
