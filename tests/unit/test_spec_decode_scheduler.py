"""Speculative decoding in the scheduler: n-gram drafts fed after a decode's last token, the
step's budget and blocks they take, and their rollback when the (fake) target rejects them."""

from __future__ import annotations

import pytest
from helpers.clock import TickingClock
from helpers.scheduler import EOS, RecordingScheduler, check_output

from moeserve.sampling_params import SamplingParams, StructuredOutputs
from moeserve.scheduler import Request, SchedulerConfig
from moeserve.scheduler.config import blocks_for_tokens
from moeserve.spec_decode import SpeculativeConfig, can_draft

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def target(tokens: list[int]) -> int:
    """A deterministic 'model': mostly a cycle over a few tokens (drafts hit), sometimes not."""
    if len(tokens) % 7 == 0:
        return 40 + len(tokens) % 5
    return 10 + (tokens[-1] * 3) % 4


def make_scheduler(speculative: SpeculativeConfig | None, **overrides) -> RecordingScheduler:
    fields = (
        dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_kv_blocks=64) | overrides
    )
    return RecordingScheduler(SchedulerConfig(**fields, speculative=speculative), clock=TickingClock())


def run(scheduler: RecordingScheduler, prompts: dict[str, list[int]], max_tokens: int = 20) -> dict[str, list[int]]:
    """Drive the scheduler with a runner that verifies drafts greedily against `target`; the
    outputs, and in `scheduler.accepted` how many drafts were kept."""
    scheduler.accepted = 0
    for request_id, prompt in prompts.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.add_request(Request(request_id, list(prompt), params, (EOS,), arrival_time=0.0))
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 500
        output = scheduler.schedule()
        check_output(scheduler, output)
        sampled = {}
        for s in output.scheduled:
            if not s.sample:
                continue
            request = scheduler.added[s.request_id]
            known = request.all_token_ids
            drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
            kept = []
            for draft in drafts:
                if draft != target(known + kept):
                    break
                kept.append(draft)
            sampled[s.request_id] = [*kept, target(known + kept)]
            scheduler.accepted += len(kept)
        scheduler.update(output, sampled)
        for request_id in prompts:
            request = scheduler.added[request_id]
            if scheduler.is_live(request_id):
                # Blocks taken for rejected drafts are back: none past the request's tokens.
                assert len(request.block_ids) <= blocks_for_tokens(request.num_tokens, 4)
    return {request_id: scheduler.added[request_id].output_token_ids for request_id in prompts}


PROMPTS = {"a": [10, 11, 12, 10, 11], "b": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "c": [11, 10, 13, 12, 11, 10]}


@pytest.mark.parametrize("overrides", [{}, {"num_kv_blocks": 16}, {"enable_prefix_caching": False}])
def test_drafts_change_no_token_and_leak_no_block(overrides):
    expected = run(make_scheduler(None, **overrides), PROMPTS)
    scheduler = make_scheduler(NGRAM, **overrides)
    assert run(scheduler, PROMPTS) == expected
    assert scheduler.accepted > 10
    assert scheduler.block_manager.num_used_blocks == 0
    if overrides.get("num_kv_blocks"):
        assert any(r.num_preemptions for r in scheduler.added.values())


def decoding(scheduler: RecordingScheduler, prompts: dict[str, list[int]], max_tokens: int) -> None:
    """Queue the prompts and run their prefill (one step), each sampling token 11."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for request_id, prompt in prompts.items():
        scheduler.add_request(Request(request_id, prompt, params, (EOS,), arrival_time=0.0))
    prefill = scheduler.schedule()
    assert all(s.sample for s in prefill.scheduled)
    scheduler.update(prefill, {s.request_id: 11 for s in prefill.scheduled})


def test_drafts_count_in_the_budget_and_every_decode_keeps_its_token():
    scheduler = make_scheduler(NGRAM, max_num_batched_tokens=9)
    decoding(scheduler, {r: [10, 11, 10] for r in "xyz"}, max_tokens=10)
    output = scheduler.schedule()
    assert [s.num_draft_tokens for s in output.scheduled] == [3, 3, 0]
    assert output.scheduled[0].token_ids == [11, 10, 11, 10]
    assert output.num_batched_tokens == 9


def test_drafts_stop_short_of_max_tokens():
    scheduler = make_scheduler(NGRAM)
    decoding(scheduler, {"x": [10, 11, 10]}, max_tokens=3)
    assert [s.token_ids for s in scheduler.schedule().scheduled] == [[11, 10]]


def test_only_requests_whose_drafts_verify_exactly_draft():
    scheduler = make_scheduler(NGRAM, max_num_seqs=8, max_num_batched_tokens=40, enable_prefix_caching=False)
    grammar = StructuredOutputs("regex", "[ab]+")
    drafting = [
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=0.8),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=grammar),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.2),
        SamplingParams(max_tokens=8, temperature=0.7, presence_penalty=0.5),
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3),
    ]
    others = [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=grammar, ignore_eos=True)]
    for i, params in enumerate([*drafting, *others]):
        scheduler.add_request(Request(str(i), [10, 11, 10, 11, 10], params, (EOS,), arrival_time=0.0))
    prefill = scheduler.schedule()
    scheduler.update(prefill, {s.request_id: 11 for s in prefill.scheduled if s.sample})
    assert [s.num_draft_tokens for s in scheduler.schedule().scheduled] == [3, 3, 3, 3, 3, 3, 3, 0]


def test_a_grammar_drafts_with_ngram_drafts_only():
    """The engine core walks the grammar over drafts it knows before the forward: MTP's are
    filled on the ranks, after the mask."""
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs("regex", "[ab]+"))
    assert can_draft(params, "ngram") and not can_draft(params, "mtp")
    assert can_draft(SamplingParams(max_tokens=8, logprobs=2, presence_penalty=0.5, min_tokens=4), "mtp")
