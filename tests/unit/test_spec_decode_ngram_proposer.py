"""The incremental n-gram proposer the scheduler runs proposes exactly what the plain backward scan
(`propose_ngram`, the search by its definition) proposes, however its tokens arrive."""

from __future__ import annotations

import random

import pytest
from helpers.clock import TickingClock
from helpers.scheduler import EOS, RecordingScheduler, check_output

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, ScheduledRequest, SchedulerConfig
from moeserve.spec_decode import NgramProposer, SpeculativeConfig, propose_ngram


@pytest.mark.parametrize("min_n, max_n", [(1, 5), (2, 4), (3, 3), (1, 1)])
def test_the_proposer_agrees_with_the_scan_at_every_length_of_many_random_sequences(min_n, max_n):
    """Small vocabularies make matches of every n (and loops the drafts run on into); tokens come
    a prompt's worth at once, then in random bursts as kept drafts do, and every proposal after
    every burst is compared, for several draft counts."""
    rng = random.Random(min_n * 10 + max_n)
    proposals = matched = 0
    for _ in range(150):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        proposer = NgramProposer(min_n, max_n)
        proposer.extend(tokens)
        while len(tokens) < 120:
            assert proposer.num_tokens == len(tokens)
            for num_tokens in (1, 3, 7):
                expected = propose_ngram(tokens, num_tokens, min_n, max_n)
                assert proposer.propose(num_tokens) == expected, (tokens, num_tokens)
                proposals += 1
                matched += bool(expected)
            burst = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 4]))]
            tokens += burst
            proposer.extend(burst)
    assert matched > proposals // 2 and matched < proposals  # both outcomes were compared


def test_a_draft_near_the_end_runs_on_into_the_drafts():
    proposer = NgramProposer(1, 3)
    proposer.extend([9, 1, 2, 1, 2])
    assert proposer.propose(5) == propose_ngram([9, 1, 2, 1, 2], 5, 1, 3) == [1, 2, 1, 2, 1]


def test_the_scheduler_drafts_what_the_scan_finds_through_chunked_prefill_and_preemption():
    """Prompts longer than a step's budget are read chunk by chunk, and few blocks force
    preemptions (recomputed from the start): each step's drafts are still the scan's over the
    request's whole sequence. (A step may draft none where the scan finds some: a prompt's last
    chunk, or no block free for them.)"""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4)
    config = SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=40, max_model_len=128, block_size=4, num_kv_blocks=40, speculative=spec
    )
    scheduler = RecordingScheduler(config, clock=TickingClock())
    rng = random.Random(7)
    for i in range(3):
        prompt = [rng.randrange(1, 6) for _ in range(60 + 10 * i)]
        params = SamplingParams(max_tokens=40, temperature=0.0)
        scheduler.add_request(Request(f"r{i}", prompt, params, (EOS,), arrival_time=0.0))
    drafted = 0

    def verify(s: ScheduledRequest) -> list[int]:
        """Check the step's drafts against the scan; keep a random number of them."""
        nonlocal drafted
        drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
        if drafts:
            assert drafts == propose_ngram(scheduler.added[s.request_id].all_token_ids, len(drafts), 1, 4)
            drafted += 1
        return [*drafts[: rng.randrange(len(drafts) + 1)], rng.randrange(1, 6)]

    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        check_output(scheduler, output)
        scheduler.update(output, {s.request_id: verify(s) for s in output.scheduled if s.sample})
    assert not scheduler.has_unfinished_requests()
    assert drafted > 20
    assert any(r.num_preemptions for r in scheduler.added.values())
