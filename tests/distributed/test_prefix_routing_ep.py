"""Prefix-aware placement in the real multi-process engine: at ep=2 (two data-parallel groups),
requests sharing a prefix land in one group, which the prefix cache counts show (the prefix is
computed once), and the tokens are one process's without caching."""

from __future__ import annotations

import torch
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=96)
PREFIX_LEN = 40  # five full blocks of 8


def test_requests_sharing_a_prefix_share_a_group_at_ep2(make_checkpoint):
    folder = str(make_checkpoint("qwen3_moe", 5, num_experts=8))  # the EP parity tests' checkpoint
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 300, (PREFIX_LEN,), generator=g).tolist()
    sharers = [prefix + torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 4, 7)]
    prompts = [{"prompt_token_ids": p} for p in [*sharers, torch.randint(3, 300, (30,), generator=g).tolist()]]
    expected = LLM(folder, enable_prefix_caching=False, **ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    counts = CountingStatLogger()
    with LLM(folder, ep=2, stat_loggers=[counts], **ENGINE) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    # One group computed the prefix and two sharers found it; placed by load alone, the groups
    # would have taken sharers 0 and 2 and sharer 1 respectively, and sharer 1 computed it again.
    assert counts.prefix_cache_hits == 2 * PREFIX_LEN
    assert counts.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in prompts)
