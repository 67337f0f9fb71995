"""The grammar's bitmask in the sampler: a masked token is never sampled, greedy or at random,
and rows without a mask sample exactly as they would without one."""

from __future__ import annotations

import pytest
import torch

from moeserve.sampling_params import SamplingParams
from moeserve.worker.sampler import Sampler, make_generator, metadata_for_rows
from moeserve.worker.sampling_metadata import SamplingRow, TokenBitmask

V = 70  # three int32 words, the last one partly past the vocabulary


def pack(allowed: list[set[int]]) -> torch.Tensor:
    """xgrammar's layout: bit t % 32 of word t // 32 set when token t is allowed."""
    words = torch.zeros(len(allowed), (V + 31) // 32, dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # bit 31 wraps to a negative word, as in xgrammar's masks


@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
def test_masked_tokens_are_never_sampled(temperature: float) -> None:
    torch.manual_seed(0)
    allowed = [{3, 31, 63, 69}, {0, 32}]
    logits = torch.randn(4, V) * 4
    logits[0, 5] = 100.0  # the favourite of a constrained row is forbidden
    params = SamplingParams(temperature=temperature, top_k=0)
    bitmask = TokenBitmask(("c0", "c1"), pack(allowed))
    request_ids = ["c1", "free", "c0", "free2"]
    seen: set[int] = set()
    for seed in range(60 if temperature else 1):
        rows = [SamplingRow(params, (), (), make_generator(seed * 4 + i, "cpu")) for i in range(4)]
        metadata = metadata_for_rows(rows, V, (), "cpu")
        tokens = Sampler().sample(logits, metadata, bitmask.for_rows(request_ids, "cpu")).token_ids.tolist()
        assert tokens[0] in allowed[1] and tokens[2] in allowed[0]
        seen.add(tokens[2])
    assert len(seen) >= (2 if temperature >= 3 else 1)  # at random, more than the favourite comes up


def test_unmasked_rows_sample_as_without_a_mask() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=0.8, seed=7)

    def sample(bitmask: TokenBitmask | None) -> list[int]:
        rows = [SamplingRow(params, (), (), make_generator(7 + i, "cpu")) for i in range(3)]
        allowed = None if bitmask is None else bitmask.for_rows(["a", "b", "c"], "cpu")
        return Sampler().sample(logits, metadata_for_rows(rows, V, (), "cpu"), allowed).token_ids.tolist()

    free = sample(None)
    masked = sample(TokenBitmask(("b",), pack([{11}])))
    assert masked[1] == 11 and masked[0] == free[0] and masked[2] == free[2]


def test_logprobs_see_the_mask() -> None:
    """As in vLLM, the mask applies before logprobs: a forbidden token has logprob -inf."""
    logits = torch.zeros(1, V)
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), (), (), None)]
    allowed = TokenBitmask(("a",), pack([{4, 40}])).for_rows(["a"], "cpu")
    out = Sampler().sample(logits, metadata_for_rows(rows, V, (), "cpu"), allowed)
    ids, values = out.top_logprobs
    assert set(ids[0].tolist()) == {4, 40} and torch.allclose(values[0], torch.log(torch.tensor([0.5, 0.5])))


def test_for_rows_maps_request_ids_to_batch_rows() -> None:
    bitmask = TokenBitmask(("x", "y"), pack([{1}, {2}]))
    assert bitmask.for_rows(["z"], "cpu") is None
    allowed = bitmask.for_rows(["y", "z", "x"], "cpu")
    assert allowed.rows.tolist() == [0, 2]
    assert torch.equal(allowed.bitmask, pack([{2}, {1}]))
