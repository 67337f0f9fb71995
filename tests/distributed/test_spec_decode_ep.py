"""Speculative decoding across rank processes: at ep=4 every rank runs the verify forward over
the drafts (their tokens count in each rank's MoE dispatch bound), the sampling ranks keep the
drafts, and the greedy tokens equal those of one process without drafts, for DeepSeek-V3 (MLA)
and GLM-4.5, with n-gram drafts and with MTP drafts."""

from __future__ import annotations

import pytest
import torch
from helpers.mtp_checkpoints import mtp_checkpoint
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams
from moeserve.sampling_params import StructuredOutputs

ENGINE = dict(block_size=4, max_model_len=96)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_ngram_drafts_at_ep4_give_one_process_greedy_tokens(make_checkpoint, arch) -> None:
    folder = str(make_checkpoint(arch, 3))
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (7, 23)]
    prompts += [{"prompt_token_ids": [40, 41, 42, 43] * 4}, {"prompt_token_ids": [9, 8] * 8}]
    expected = LLM(folder, **ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    counts = CountingStatLogger()
    with LLM(folder, ep=4, speculative_config=NGRAM, stat_loggers=[counts], **ENGINE) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert counts.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("arch, tp", [("deepseek_v3", 1), ("glm4_moe", 2)])
def test_mtp_drafts_at_ep4_give_one_process_greedy_tokens(tmp_path_factory, arch, tp) -> None:
    """Every rank runs the MTP passes (their MoE joins the all-to-all even when a rank has no
    drafting sequence) and fills the same drafts its sampling rank verifies; under tp=2 each
    rank of a group computes the drafts from the same gathered rows."""
    folder = str(mtp_checkpoint(tmp_path_factory.mktemp("mtp"), arch))
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (7, 23, 12)]
    expected = LLM(folder, **ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    for k in (1, 3):
        counts = CountingStatLogger()
        mtp = {"method": "mtp", "num_speculative_tokens": k}
        with LLM(folder, ep=4, tp=tp, speculative_config=mtp, stat_loggers=[counts], **ENGINE) as llm:
            got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert counts.spec_decode.num_accepted_tokens > 0


def test_ngram_drafts_at_ep4_under_grammar_logprobs_and_penalties_give_one_process_tokens(make_checkpoint) -> None:
    """The grammar's per-draft mask rows reach the sampling ranks with the plan (every rank reads
    the same mask), and penalties, min_tokens and logprobs are judged there per draft position."""
    folder = str(make_checkpoint("deepseek_v3", 3))
    prompts = [{"prompt_token_ids": [40, 41, 42, 43] * 4}, {"prompt_token_ids": [9, 8] * 8}] * 2
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs("regex", "(ab|ba)+")),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=0.2),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, stop_token_ids=[41, 8]),
    ]
    expected = LLM(folder, **ENGINE).generate(prompts, params, use_tqdm=False)
    counts = CountingStatLogger()
    with LLM(folder, ep=4, speculative_config=NGRAM, stat_loggers=[counts], **ENGINE) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for out, ref in zip(got[1::4], expected[1::4]):
        pairs = [(t, e.logprob) for pos in out.outputs[0].logprobs for t, e in sorted(pos.items())]
        ref_pairs = [(t, e.logprob) for pos in ref.outputs[0].logprobs for t, e in sorted(pos.items())]
        assert [t for t, _ in pairs] == [t for t, _ in ref_pairs]
        assert [lp for _, lp in pairs] == pytest.approx([lp for _, lp in ref_pairs], abs=1e-4)
    assert counts.spec_decode.num_accepted_tokens > 0
