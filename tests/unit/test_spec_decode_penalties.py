"""Speculative decoding for requests with penalties or a pending min_tokens: each draft is judged
with the penalties counting the tokens before it (the output so far and the drafts before it) and
with min_tokens masking while the position is still under the minimum, so greedy tokens are those
of decoding without drafts, token for token."""

from __future__ import annotations

import pytest
from helpers.spec_decode import ENGINE, NGRAM, looping_prompts
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

PROMPTS = looping_prompts()


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return str(make_checkpoint("deepseek_v3", 3))


def greedy(**options) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **options)


def test_greedy_tokens_with_penalties_and_min_tokens_are_those_without_drafts(folder):
    base = LLM(folder, **ENGINE).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    early = base[3].outputs[0].token_ids[4]  # a token greedy decoding emits early: min_tokens holds it back
    variants = [
        greedy(repetition_penalty=1.15),
        greedy(frequency_penalty=0.3),
        greedy(presence_penalty=0.4, repetition_penalty=1.05),
        greedy(min_tokens=14, stop_token_ids=[early]),
    ]
    batch = [{"prompt_token_ids": p} for p in PROMPTS for _ in variants]
    params = [v for _ in PROMPTS for v in variants]
    expected = LLM(folder, **ENGINE).generate(batch, params, use_tqdm=False)
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], speculative_config=NGRAM, **ENGINE)
    got = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    held_back = expected[3 * len(variants) + 3].outputs[0]
    assert early not in held_back.token_ids[:14] and held_back.token_ids[:4] == base[3].outputs[0].token_ids[:4]
    assert counts.spec_decode.num_accepted_tokens > 0
    assert llm.engine.scheduler.num_used_blocks == 0
