"""Prompt logprobs through the offline engine: equal to transformers' log-softmax over the
prompt, across chunked prefill, with n > 1 and under preemption (each position reported once),
and joined once by the output processor whichever sample reports them first."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import SLOConfig
from moeserve.engine.core import CoreStep, SchedulerStats
from moeserve.engine.output_processor import OutputProcessor
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.stats import IterationStats
from moeserve.worker import PromptLogprobs, SampledToken

PROMPT_LENGTHS = (1, 9, 26)
NUM_TOP = 3


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return make_checkpoint("qwen3_moe", 11)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(folder, prompts) -> list[torch.Tensor]:
    """transformers' float32 log-softmax at every prompt position, `[len, V]` per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


def check(output: RequestOutput, prompt: list[int], ref: torch.Tensor, num_top: int) -> None:
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        expected = ref[i - 1]
        entry = got[i]
        token = entry[prompt[i]]
        assert abs(token.logprob - expected[prompt[i]].item()) < 1e-4, f"position {i}"
        assert token.rank == int((expected > expected[prompt[i]]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
        assert [t for _, t in top] == expected.topk(num_top).indices.tolist()
        for t, lp in entry.items():
            assert abs(lp.logprob - expected[t].item()) < 1e-4
        assert len(entry) in (num_top, num_top + 1)


def test_prompt_logprobs_match_transformers_with_chunked_prefill(folder, prompts, reference):
    # 8 tokens a step: the longer prompts arrive over two to four chunks, sharing steps.
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, prompt, ref in zip(outputs, prompts, reference):
        check(output, prompt, ref, NUM_TOP)
    # Requests that did not ask get none, and n > 1 reports the shared prompt once.
    plain = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    twice = SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=3, prompt_logprobs=0)
    (output,) = llm.generate([{"prompt_token_ids": prompts[2]}], twice)
    assert len(output.outputs) == 2
    check(output, prompts[2], reference[2], 0)


def test_preempted_prompt_reports_its_logprobs_once(folder, prompts, reference):
    """A KV pool so small that sequences are preempted and their prompts recomputed."""
    llm = LLM(str(folder), block_size=4, max_model_len=48, kv_cache_blocks=14, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    scheduler, preempted = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def counting_schedule():
        plan = schedule()
        preempted.extend(plan.preempted_request_ids)
        return plan

    scheduler.schedule = counting_schedule
    executor, covered = llm.engine.executor, {}
    take = executor.take_prompt_logprobs

    def recording_take():
        taken = take()
        for request_id, chunk in taken.items():
            covered.setdefault(request_id, []).extend(range(chunk.start, chunk.end))
        return taken

    executor.take_prompt_logprobs = recording_take
    # Three 13-token prompts (4 blocks each) are admitted together, then outgrow the pool.
    heads = [prompts[2][:13], prompts[2][13:26], prompts[1] + prompts[1][:4]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in heads], params)
    assert preempted
    # The core reports every position once: the recomputed prompts' positions are not sent again.
    assert sorted(covered.values()) == [list(range(1, 13))] * 3
    check(outputs[0], heads[0], reference[2], 1)  # causal: a prefix's logprobs are the whole prompt's first ones
    assert [len(out.prompt_logprobs) for out in outputs[1:]] == [13, 13]


def test_samples_chunks_join_once_whichever_runs_ahead(folder):
    """n = 2: both samples report the prompt; overlapping chunks give each position once."""
    from transformers import AutoTokenizer

    processor = OutputProcessor(AutoTokenizer.from_pretrained(folder), SLOConfig())
    prompt = [5, 6, 7, 8, 9, 10]
    processor.add_request("r", None, prompt, SamplingParams(n=2, prompt_logprobs=0), 0.0, ["r#0", "r#1"])

    def chunk(start: int, end: int) -> PromptLogprobs:
        return PromptLogprobs(
            start, [-float(i) for i in range(start, end)], [i for i in range(start, end)], [[]] * (end - start)
        )

    def step(prompt_logprobs: dict, sampled: dict) -> list:
        core_step = CoreStep(sampled, [], {}, 1.0, 0.01, 0, SchedulerStats(0, 0, 0, 0), prompt_logprobs=prompt_logprobs)
        return processor.process(core_step, IterationStats()).outputs

    assert step({"r#1": chunk(1, 4), "r#0": chunk(1, 3)}, {}) == []
    (output,) = step({"r#0": chunk(3, 5), "r#1": chunk(4, 6)}, {"r#1": SampledToken(11)})
    assert output.prompt_logprobs[0] is None
    assert [(e[t].logprob, e[t].rank) for e, t in zip(output.prompt_logprobs[1:], prompt[1:])] == [
        (-float(i), i) for i in range(1, 6)
    ]
