"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against transformers.

Checkpoints written by transformers: three layers, the indexer keeping the top 16 of contexts of
40 to 232 tokens, so most queries attend to a small part of what they see (GLM-5's layer 1
reuses layer 0's top-k). The prefill logits match, and differ from the same weights attending
densely (the selection changes the result); 32 greedy tokens match in chunks of 16 tokens, and
again when the prompts come back from the prefix cache (the indexer keys shared like the latent).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.dsa import config_of, prompts_for
from helpers.reference import hf_greedy_tokens, hf_model, prefill_logits
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams
from moeserve.cache_spec import PagedSpec
from moeserve.checkpoints import MakeModelSpec
from moeserve.checkpoints.mtp import write_mtp_layers
from moeserve.models import load_model
from moeserve.models.decoder import cache_specs
from moeserve.plan.sparse_attention import decode_attention_cost

ARCHS = ("deepseek_v32", "glm_moe_dsa")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


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


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_drafts_give_the_greedy_tokens(make_checkpoint, tmp_path, arch):
    """A one-layer target (MoE) and an MTP layer (checkpoint layer 1) copied from it as
    `checkpoints.mtp` aligns it, indexer included, as the releases' MTP layers have one: it runs
    its own indexer over its own keys. Two drafts a step, prompts past the top-k: the tokens are
    plain greedy's, and drafts are kept (so accepted drafts' keys stay, rejected ones' are
    overwritten)."""
    folder = tmp_path / arch
    shutil.copytree(make_checkpoint(arch, num_hidden_layers=1, first_k_dense_replace=0), folder)
    write_mtp_layers(
        MakeModelSpec(arch, layers=1, first_k_dense_replace=0, mtp_layers=1, mtp_init="aligned"), None, folder
    )
    requests = [{"prompt_token_ids": p} for p in prompts_for(2, (30, 70))]
    options = dict(dtype="float32", max_num_seqs=4, max_model_len=160)
    plain = [o.outputs[0].token_ids for o in LLM(str(folder), **options).generate(requests, GREEDY, use_tqdm=False)]
    counts = CountingStatLogger()
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    drafting = LLM(str(folder), speculative_config=mtp, stat_loggers=[counts], **options)
    assert [o.outputs[0].token_ids for o in drafting.generate(requests, GREEDY, use_tqdm=False)] == plain
    assert counts.spec_decode.accepted_per_position[0] > counts.spec_decode.num_drafts / 4
    assert drafting.engine.scheduler.num_used_blocks == 0


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
