"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against transformers.

Checkpoints written by transformers: three layers, the indexer keeping the top 16 of contexts of
40 to 232 tokens, so most queries attend to a small part of what they see (GLM-5's layer 1
reuses layer 0's top-k). The prefill logits match, and differ from the same weights attending
densely (the selection changes the result); 32 greedy tokens match in chunks of 16 tokens, and
again when the prompts come back from the prefix cache (the indexer keys shared like the latent).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model, prefill_logits
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams
from moeserve.cache_spec import PagedSpec
from moeserve.config import EngineConfig, ModelConfig
from moeserve.engine.core import sparse_attention_refusal
from moeserve.models import load_model, resolve_architecture
from moeserve.models.decoder import cache_specs
from moeserve.ops import TorchOps
from moeserve.ops.registry import OPS_BACKENDS
from moeserve.plan.sparse_attention import decode_attention_cost

ARCHS = ("deepseek_v32", "glm_moe_dsa")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def config_of(folder) -> ModelConfig:
    return resolve_architecture(json.loads((folder / "config.json").read_text()))[1]


def prompts_for(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(4000 + seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_and_the_selection_matters(make_checkpoint, arch):
    prompts = prompts_for(0, (5, 40, 90))
    sparse, dense = make_checkpoint(arch), make_checkpoint(arch, index_topk=256)  # same weights
    with torch.inference_mode():
        expected = torch.cat([hf_model(sparse)(torch.tensor([p])).logits[0] for p in prompts])
    got = prefill_logits(load_model(sparse), prompts)
    assert (got - expected).abs().max().item() < 1e-4
    short = prompts[0]  # 5 tokens: below index_topk every query sees all it may, sparse or not
    attending_all = prefill_logits(load_model(dense), prompts)
    assert torch.allclose(attending_all[: len(short)], got[: len(short)], atol=1e-5)
    assert (attending_all - got).abs().max().item() > 0.1


def test_cache_specs_hold_the_indexer_keys_beside_the_latent(make_checkpoint):
    """DeepSeek-V3.2: every layer keeps its latent (16 + 8) and its indexer keys (16); GLM-5's
    layer 1, reusing layer 0's top-k, keeps no keys. A block's bytes count both."""
    v32 = cache_specs(config_of(make_checkpoint("deepseek_v32")), torch.bfloat16)
    latent, keys = PagedSpec((), (24,), "bfloat16"), PagedSpec((), (16,), "bfloat16")
    assert v32.layers == ((latent, keys),) * 3
    assert v32.bytes_per_block(16) == 16 * 3 * (24 + 16) * 2
    glm = cache_specs(config_of(make_checkpoint("glm_moe_dsa")), torch.bfloat16)
    assert glm.layers == ((latent, keys), latent, (latent, keys))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_in_chunks_and_from_the_prefix_cache(make_checkpoint, arch):
    folder = make_checkpoint(arch)
    ref = hf_model(folder)
    prompts = prompts_for(1, (40, 97, 200))
    counts = CountingStatLogger()
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        stat_loggers=[counts],
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [hf_greedy_tokens(ref, p, 32) for p in prompts]
    first = llm.generate(requests, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    hits = counts.prefix_cache_hits
    cached = llm.generate(requests, GREEDY, use_tqdm=False)
    assert counts.prefix_cache_hits - hits >= sum(len(p) for p in prompts) - 3 * 16  # all but the last blocks
    assert [list(o.outputs[0].token_ids) for o in cached] == expected
    assert llm.engine.scheduler.num_used_blocks == 0


def test_features_not_built_for_sparse_attention_are_refused(make_checkpoint):
    folder = str(make_checkpoint("glm_moe_dsa"))
    mtp = EngineConfig.from_options(model=folder, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert "method 'mtp' is not built for DeepSeek Sparse Attention" in sparse_attention_refusal(mtp)
    assert sparse_attention_refusal(EngineConfig.from_options(model=folder)) is None
    cfg = config_of(make_checkpoint("glm_moe_dsa"))
    assert "no DeepSeek Sparse Attention" in OPS_BACKENDS["triton"].load().supports_model(cfg)
    assert TorchOps.supports_model(cfg) is None


def test_decode_attention_cost_from_the_specs(make_checkpoint):
    """The tiny models at 100 tokens: MLA of 4 heads over the top 16 (4 x (2 x 24 + 2 x 16) FLOPs
    and a 48-byte latent per token), the indexer's 16 heads of 16 over all 100 (32-byte keys);
    GLM-5's layer 1 runs no indexer. Dense: MLA over all 100, no indexer."""
    v32 = config_of(make_checkpoint("deepseek_v32"))
    sparse = decode_attention_cost(v32, 100)
    assert (sparse.flops, sparse.bytes) == (3 * (16 * 320 + 100 * 16 * 34), 3 * (16 * 48 + 100 * 32))
    dense = decode_attention_cost(v32, 100, sparse=False)
    assert (dense.flops, dense.bytes) == (3 * 100 * 320, 3 * 100 * 48)
    glm = decode_attention_cost(config_of(make_checkpoint("glm_moe_dsa")), 100)
    assert glm.flops == 3 * 16 * 320 + 2 * 100 * 16 * 34
