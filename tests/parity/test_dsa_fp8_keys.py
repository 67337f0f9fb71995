"""DeepSeek-V3.2's indexer keys cached in FP8 (`--indexer-key-dtype fp8`), as its release does:
the spec's bytes, the memory budget counting them, the top-k they choose against the compute
dtype's, and a greedy run through the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.dsa import config_of, prompts_for
from helpers.reference import prefill_logits

from moeserve import LLM, SamplingParams
from moeserve.cache_spec import PagedSpec
from moeserve.engine_config import CacheConfig
from moeserve.models import load_model
from moeserve.models.decoder import cache_specs
from moeserve.models.layers import dsa
from moeserve.ops.sparse_mla import fp8_key_rows, indexer_topk, keys_of_rows
from moeserve.ops.torch_ops import TorchOps
from moeserve.ops.triton_ops import TritonOps
from moeserve.worker.kv_cache import allocate_kv_caches, num_blocks_for

INDEX_HEAD_DIM = 16  # the tiny checkpoints' (their latent: 24)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_fp8_keys_cost_head_dim_plus_4_bytes_and_the_budget_counts_them(make_checkpoint):
    """At DeepSeek-V3.2's index_head_dim 128 a key is 132 bytes (128 e4m3 and a float32 scale),
    beside the bf16 latent (24 x 2 bytes on the tiny model); the cache holds them as uint8 rows."""
    cfg = config_of(make_checkpoint("deepseek_v32"))
    assert cfg.dsa is not None
    release = replace(cfg, dsa=replace(cfg.dsa, index_head_dim=128)).with_indexer_key_dtype("fp8")
    specs = cache_specs(release, torch.bfloat16)
    assert specs.layers == ((PagedSpec((), (24,), "bfloat16"), PagedSpec((), (132,), "uint8")),) * 3
    assert specs.bytes_per_block(16) == 16 * 3 * (48 + 132)
    budget = CacheConfig(block_size=16, memory_bytes=100 * 16 * 3 * (48 + 132) + 5)
    assert num_blocks_for(release, budget, torch.bfloat16, max_num_seqs=64, max_model_len=4096) == 100
    plain = replace(cfg, dsa=replace(cfg.dsa, index_head_dim=128))
    assert num_blocks_for(plain, budget, torch.bfloat16, max_num_seqs=64, max_model_len=4096) == 100 * 180 // 304
    latent, keys = allocate_kv_caches(release, 2, 16, torch.bfloat16, "cpu")[0]
    assert (latent.dtype, keys.dtype, keys.shape) == (torch.bfloat16, torch.uint8, (2, 16, 132))
    assert "not FP8" in TritonOps.supports_model(release) and TritonOps.supports_model(plain) is None
    with pytest.raises(ValueError, match="has no lightning indexer"):
        replace(cfg, dsa=None).with_indexer_key_dtype("fp8")


class RecordingOps(TorchOps):
    """Keeps each indexer call's queries, weights, keys (copied: the cache is reused) and plan."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def dsa_select(self, q, weights, key_cache, plan, index_topk):
        self.calls.append((q, weights, key_cache.clone(), plan, index_topk))
        return super().dsa_select(q, weights, key_cache, plan, index_topk)


def test_fp8_keys_choose_the_same_top_k_but_for_near_ties(make_checkpoint):
    """Every indexer call of a prefill of three prompts (40 to 200 tokens, top 16), rescored with
    the keys round-tripped through FP8 rows: the chosen positions agree with the float32 keys'
    but for near-ties swapping at the edge of the top 16."""
    ops = RecordingOps()
    prefill_logits(load_model(make_checkpoint("deepseek_v32"), ops=ops), prompts_for(1000, (40, 97, 200)))
    same = total = 0
    for q, weights, keys, plan, topk in ops.calls:
        rows = fp8_key_rows(keys.view(-1, keys.shape[-1])).view(*keys.shape[:2], -1)
        for exact, fp8 in zip(indexer_topk(q, weights, keys, plan, topk), indexer_topk(q, weights, rows, plan, topk)):
            if exact is None:
                assert fp8 is None
                continue
            agree = (exact.sort(-1).values[..., :, None] == fp8[..., None, :]).any(-1)
            same, total = same + int(agree.sum()), total + agree.numel()
    print(f"FP8 keys' top-k agreement: {same / total:.4f} of {total} chosen positions")
    assert total > 10_000 and same / total > 0.97


def test_greedy_tokens_with_fp8_keys(make_checkpoint, monkeypatch):
    """Through the engine with chunked prefill, top 48 of contexts up to 92. A random tiny model's
    indexer scores are dense with near-ties, so FP8 keys flip some choices and, later, tokens:
    transformers' (compute-dtype keys) is not the reference here. The reference is the
    compute-dtype cache with each key rounded through FP8 before it is cached: the FP8 rows must
    hold exactly that, chunk after chunk, so both prompts' tokens equal its."""
    folder = make_checkpoint("deepseek_v32", index_topk=48)
    prompts = [*prompts_for(1002, (40,)), *prompts_for(1001, (60,))]
    options = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=32, max_model_len=96)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(str(folder), indexer_key_dtype="fp8", **options)
    fp8 = [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY, use_tqdm=False)]
    assert llm.engine.scheduler.num_used_blocks == 0

    write = dsa.write_to_cache

    def write_rounded(cache, values, slots):
        if cache.shape[-1] == values.shape[-1] == INDEX_HEAD_DIM:  # the indexer's keys, not the latent
            values = keys_of_rows(fp8_key_rows(values), INDEX_HEAD_DIM)
        write(cache, values, slots)

    monkeypatch.setattr(dsa, "write_to_cache", write_rounded)
    rounded = LLM(str(folder), **options).generate(requests, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in rounded] == fp8
