"""The runner's persistent batch: state kept across steps samples exactly as rebuilding it would."""

from __future__ import annotations

import pytest
import torch

from moeserve.sampling_params import SamplingParams
from moeserve.worker.input_batch import InputBatch
from moeserve.worker.runner import packed_positions
from moeserve.worker.sampler import Sampler, SamplingRow

VOCAB, EOS, STOP = 40, 3, 5


def test_persistent_batch_samples_as_the_stateless_sampler():
    """Eight steps with joins, a leave, reordered rows and a penalised request taking a freed
    penalty row: tokens and penalised logprobs equal the stateless sampler's, which counts each
    row's tokens from scratch every step."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "rep": SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        "freq": SamplingParams(
            temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3, min_tokens=3, stop_token_ids=[STOP]
        ),
        "plain": SamplingParams(temperature=0.0, min_tokens=2),
        "late": SamplingParams(temperature=0.0, presence_penalty=1.0, repetition_penalty=0.8, logprobs=0),
    }
    prompts = {name: torch.randint(0, VOCAB, (6,), generator=gen).tolist() for name in params}
    base = {name: torch.randn(VOCAB, generator=gen) for name in params}  # each row favours the same tokens
    outputs: dict[str, list[int]] = {name: [] for name in params}
    batch = InputBatch(VOCAB, [EOS], "cpu", capacity=2)  # too small: it must grow
    sampler = Sampler(logprobs_mode="penalized")
    live = ["rep", "freq", "plain"]
    batch.add(live, [SamplingRow(params[n], prompts[n], (), None) for n in live])
    for step in range(8):
        if step == 3:  # "late" reuses the penalty row "rep" leaves
            batch.remove("rep")
            live.remove("rep")
            batch.add(["late"], [SamplingRow(params["late"], prompts["late"], (), None)])
            live.append("late")
        order = live[::-1] if step % 2 else live
        logits = torch.stack([base[n] for n in order]) * 3 + 0.1 * torch.randn(len(order), VOCAB, generator=gen)
        logits[:, EOS] += 4.0 if step >= 2 else 0.0
        metadata = batch.sampling_metadata([batch.slot(n) for n in order])
        out = sampler.sample(logits, metadata)
        batch.record(metadata, out.token_ids)
        rows = [SamplingRow(params[n], prompts[n], outputs[n], None) for n in order]
        expected = sampler(logits, rows, eos_token_ids=[EOS])
        assert torch.equal(out.token_ids, expected.token_ids), step
        assert torch.equal(out.logprobs, expected.logprobs), step
        for name, token in zip(order, out.token_ids.tolist()):
            outputs[name].append(token)
    assert len(set(outputs["freq"])) > 1  # the penalties did move the argmax
    assert EOS not in outputs["freq"][:3] and EOS in outputs["freq"][3:]  # min_tokens held, then let go


def test_slot_set_is_reused_until_the_batch_changes():
    batch = InputBatch(VOCAB, [EOS], "cpu")
    batch.add(["a", "b"], [SamplingRow(SamplingParams(top_k=5), (), (), None) for _ in range(2)])
    slots = [batch.slot("a"), batch.slot("b")]
    first = batch.sampling_metadata(slots)
    assert batch.sampling_metadata(slots).random is first.random  # nothing rebuilt
    batch.add(["c"], [SamplingRow(SamplingParams(), (), (), None)])
    assert batch.sampling_metadata(slots).random is not first.random


def test_bad_use_is_refused():
    batch = InputBatch(VOCAB, [EOS], "cpu")
    row = SamplingRow(SamplingParams(), (), (), None)
    batch.add(["a"], [row])
    with pytest.raises(ValueError, match="two slots"):
        batch.add(["a"], [row])
    with pytest.raises(ValueError, match="two slots"):
        batch.add(["b", "b"], [row, row])
    stale = batch.sampling_metadata([batch.slot("a")])
    batch.sampling_metadata([batch.slot("a"), batch.slot("a")])
    with pytest.raises(ValueError, match="last sampling_metadata"):
        batch.record(stale, torch.tensor([1]))


def test_packed_positions():
    assert packed_positions([0, 7, 4], [3, 1, 2]).tolist() == [0, 1, 2, 7, 4, 5]
    assert packed_positions([], []).tolist() == []
