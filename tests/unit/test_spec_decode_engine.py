"""Speculative decoding end to end through `LLM` and `LLMEngine`: greedy tokens with n-gram drafts
are those of greedy decoding without them, token for token, for DeepSeek-V3 (MLA) and GLM-4.5,
with one and three drafts; and a mixed run (preemption, prefix caching, aborts, stop tokens and
strings, sampled neighbours) leaks no KV block."""

from __future__ import annotations

import pytest
import torch
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

ENGINE = dict(block_size=4, max_model_len=96)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}


def prompts() -> list[dict]:
    """Random prompts and repetitive ones (whose continuations n-gram drafts predict)."""
    g = torch.Generator().manual_seed(11)
    random = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (6, 19, 31)]
    repetitive = [[40, 41, 42, 43] * 5, [7, 8] * 9 + [9]]
    return [{"prompt_token_ids": p} for p in random + repetitive]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def deepseek_folder(make_checkpoint):
    return make_checkpoint("deepseek_v3", 3)


@pytest.fixture(scope="module")
def glm_folder(make_checkpoint):
    return make_checkpoint("glm4_moe", 3)


@pytest.mark.parametrize("folder_fixture", ["deepseek_folder", "glm_folder"])
def test_greedy_tokens_with_ngram_drafts_are_those_without(request, folder_fixture):
    folder = str(request.getfixturevalue(folder_fixture))
    expected = token_ids(LLM(folder, **ENGINE).generate(prompts(), GREEDY, use_tqdm=False))
    for k in (1, 3):
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], speculative_config=ngram(k), **ENGINE)
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        spec = counts.spec_decode
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
        assert len(spec.accepted_per_position) == k and sum(spec.accepted_per_position) == spec.num_accepted_tokens
        assert llm.engine.scheduler.num_used_blocks == 0


def test_a_mixed_run_with_aborts_and_preemption_keeps_tokens_and_leaks_no_block(deepseek_folder):
    """Tight KV (preemption), prefix caching, chunked prefill, a stop token, a stop string, short
    max_tokens, a sampled neighbour (which never drafts) and two aborts mid-run."""
    folder = str(deepseek_folder)
    tight = dict(ENGINE, kv_cache_blocks=26, max_num_batched_tokens=16, max_num_seqs=4)
    batch = prompts() + prompts()[:2]
    base = LLM(folder, **ENGINE).generate(batch, GREEDY, use_tqdm=False)
    stop_token = base[3].outputs[0].token_ids[9]
    stop_text = base[1].outputs[0].text[-8:-4]  # late in the text: the request runs long enough to preempt
    assert stop_text.strip()
    params = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True),
        GREEDY,
        GREEDY,
    ]
    batch_params = list(zip(batch, params))

    def run(**options) -> tuple[dict[str, tuple], LLM, CountingStatLogger]:
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], **tight, **options)
        engine = llm.engine
        ids = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(batch_params)]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 6:
                engine.abort_request(ids[5])
            if steps == 9:
                engine.abort_request(ids[6])
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        return done, llm, counts

    expected, _, _ = run()
    got, llm, counts = run(speculative_config=ngram(3))
    assert got == expected
    assert counts.num_preemptions > 0 and counts.spec_decode.num_accepted_tokens > 0
    assert "5" not in got and "6" not in got  # aborted
    assert got["1"][1] == got["3"][1] == "stop" and got["2"][1] == "length"  # stop string, stop token, max_tokens
    assert llm.engine.scheduler.num_used_blocks == 0


def test_seeded_sampling_with_drafts_is_reproducible_and_greedy_neighbours_unchanged(deepseek_folder):
    """Sampled sequences draft too (rejection sampling): a seeded request draws the same tokens
    again, drafts are kept, and the greedy sequences beside it keep their plain greedy tokens."""
    folder = str(deepseek_folder)
    batch = prompts()
    sampled = [SamplingParams(max_tokens=24, temperature=0.3, seed=i, ignore_eos=True) for i in range(len(batch))]
    expected_greedy = token_ids(LLM(folder, **ENGINE).generate(batch, GREEDY, use_tqdm=False))
    runs = []
    for _ in range(2):
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], speculative_config=ngram(3), **ENGINE)
        outputs = token_ids(llm.generate(batch + batch, sampled + [GREEDY] * len(batch), use_tqdm=False))
        assert outputs[len(batch) :] == expected_greedy
        assert counts.spec_decode.num_accepted_tokens > 0
        runs.append(outputs[: len(batch)])
    assert runs[0] == runs[1]
