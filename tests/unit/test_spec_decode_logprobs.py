"""Speculative decoding for requests asking for logprobs: every token, kept draft or sampled,
carries the logprob and top logprobs of the verify forward's row it was picked from, the numbers
decoding one token at a time reports (greedy: the same tokens too; sampled: those of the target
over the tokens drawn, which teacher-forced prompt logprobs give)."""

from __future__ import annotations

import pytest
from helpers.spec_decode import ENGINE, NGRAM, looping_prompts
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

PROMPTS = looping_prompts()


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return str(make_checkpoint("deepseek_v3", 3))


def entries(output) -> list[list[tuple[int, float, int]]]:
    """Per token: (token id, logprob, rank) of each entry, sorted by token id."""
    return [sorted((t, e.logprob, e.rank) for t, e in pos.items()) for pos in output.outputs[0].logprobs]


def test_greedy_logprobs_with_drafts_are_those_without(folder):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = LLM(folder, **ENGINE).generate(batch, params, use_tqdm=False)
    counts = CountingStatLogger()
    got = LLM(folder, stat_loggers=[counts], speculative_config=NGRAM, **ENGINE).generate(batch, params, use_tqdm=False)
    assert counts.spec_decode.num_accepted_tokens > 0
    for out, ref in zip(got, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.outputs[0].logprobs) == len(ref.outputs[0].token_ids)
        for pos, ref_pos in zip(entries(out), entries(ref)):
            assert [(t, rank) for t, _, rank in pos] == [(t, rank) for t, _, rank in ref_pos]
            assert [lp for _, lp, _ in pos] == pytest.approx([lp for _, lp, _ in ref_pos], abs=1e-4)
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)


def test_sampled_logprobs_with_drafts_are_the_targets_over_the_drawn_tokens(folder):
    """Seeded sampling with drafts (rejection sampling draws the next token at a rejection): each
    token's logprob is the target's (raw) log-probability of it after the tokens before it."""
    params = [SamplingParams(max_tokens=24, temperature=0.3, seed=i, ignore_eos=True, logprobs=0) for i in range(4)]
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], speculative_config=NGRAM, **ENGINE)
    got = llm.generate(batch, params, use_tqdm=False)
    assert counts.spec_decode.num_accepted_tokens > 0
    forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    whole = [{"prompt_token_ids": p + list(o.outputs[0].token_ids)} for p, o in zip(PROMPTS, got)]
    reference = LLM(folder, **ENGINE).generate(whole, forced, use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, got, reference):
        tokens = out.outputs[0].token_ids
        assert [list(pos) for pos in out.outputs[0].logprobs] == [[t] for t in tokens]
        reported = [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, tokens)]
        teacher_forced = [pos[t].logprob for pos, t in zip(ref.prompt_logprobs[len(prompt) :], tokens)]
        assert reported == pytest.approx(teacher_forced, abs=1e-3)
