"""Prefix caching end to end through `LLM`: greedy tokens are those of an engine without it, for
a standard architecture and for DeepSeek's MLA latent cache, with prompts sharing prefixes, a
pool small enough to preempt and evict, and chunked prefill."""

from __future__ import annotations

import pytest
import torch
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=96)
# 24 blocks of 4 hold under two of these sequences; 16 tokens a step chunk every prompt.
TIGHT = dict(kv_cache_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)


def shared_prefix_prompts() -> list[dict]:
    """Two families of prompts over two prefixes (20 and 33 tokens), with suffixes of 0 to 17
    tokens: prompts ending on a block boundary, inside one, a prompt repeated verbatim and one
    that is exactly a prefix of another."""
    g = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=g).tolist()

    short, long = tokens(20), tokens(33)
    suffixes = [tokens(n) for n in (0, 3, 12, 17)]
    prompts = [prefix + suffix for prefix in (short, long) for suffix in suffixes]
    prompts.insert(3, list(prompts[1]))
    return [{"prompt_token_ids": p} for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def qwen3_folder(make_checkpoint):
    return make_checkpoint("qwen3_moe", 7, num_experts=6, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def deepseek_folder(make_checkpoint):
    return make_checkpoint("deepseek_v3", 3)


@pytest.mark.parametrize("folder_fixture", ["qwen3_folder", "deepseek_folder"])
def test_greedy_tokens_are_the_same_with_and_without_prefix_caching(request, folder_fixture):
    folder = str(request.getfixturevalue(folder_fixture))
    prompts = shared_prefix_prompts()
    expected = token_ids(LLM(folder, enable_prefix_caching=False, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], **ENGINE, **TIGHT)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert counts.num_preemptions > 0 and counts.prefix_cache_hits > 0
    # Again, in reverse: now most prefixes (and whole prompts) are cached, some evicted.
    hits = counts.prefix_cache_hits
    assert token_ids(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == expected[::-1]
    assert counts.prefix_cache_hits > hits
    assert llm.engine.scheduler.num_used_blocks == 0
