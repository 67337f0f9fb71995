"""The sampler and SamplingParams: vLLM semantics, per-request reproducibility, filter exclusion."""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.sampling_params import SamplingParams
from moeserve.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    make_generator,
)

EOS = 3
# A known distribution over 6 tokens for the statistical checks.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
DRAWS = 20_000  # std of a frequency <= sqrt(0.25 / 20_000) ~ 0.0035; tolerance below is ~6 std


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


def frequencies(params: SamplingParams, generators=None) -> torch.Tensor:
    """Empirical token frequencies over DRAWS rows that all hold PROBS's logits."""
    gens = generators or [None] * DRAWS
    rows = [row(params, generator=g) for g in gens]
    logits = PROBS.log().expand(len(rows), -1)
    tokens = Sampler()(logits, rows, eos_token_ids=[]).token_ids
    return torch.bincount(tokens, minlength=len(PROBS)).float() / len(rows)


def expected(keep: list[int]) -> torch.Tensor:
    """PROBS renormalised over `keep`."""
    p = torch.zeros_like(PROBS)
    p[keep] = PROBS[keep] / PROBS[keep].sum()
    return p


# --- SamplingParams -------------------------------------------------------------------------


def test_params_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop="###", seed=-1, stop_token_ids=(7, 8))
    assert (p.top_k, p.stop, p.seed, p.stop_token_ids) == (0, ["###"], None, [7, 8])
    d = SamplingParams()
    assert (d.n, d.max_tokens, d.temperature, d.top_p, d.stop, d.stop_token_ids) == (
        1,
        16,
        1.0,
        1.0,
        [],
        [],
    )
    assert not d.greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    c = p.clone()
    c.stop.append("x")
    assert p.stop == ["###"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_params_accepts_edges():
    SamplingParams(max_tokens=None, min_tokens=1000, logprobs=20, top_p=1.0, min_p=1.0)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, temperature=0, logprobs=0)


# --- greedy -----------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_for_any_dtype():
    logits = torch.randn(8, 50).to(torch.bfloat16)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = Sampler()(logits, rows, eos_token_ids=[])
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None and out.top_logprobs is None


def test_top_k_one_equals_greedy_ties_included():
    torch.manual_seed(0)
    logits = torch.randn(16, 40)
    logits[0, [5, 9]] = 10.0  # a tie for the max
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    top1 = SamplingParams(temperature=1.5, top_k=1, repetition_penalty=1.3)
    greedy_rows = [row(greedy, prompt=[0]) for _ in range(16)]
    top1_rows = [row(top1, prompt=[0]) for _ in range(16)]
    sampler = Sampler()
    picked = sampler(logits, top1_rows, []).token_ids
    assert torch.equal(picked, sampler(logits, greedy_rows, []).token_ids)
    assert picked[0] == 5  # the first of the tied maxima, as argmax


def test_input_logits_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    rows = [row(SamplingParams(top_k=3, repetition_penalty=2.0), prompt=[1, 2]) for _ in range(2)]
    Sampler()(logits, rows, eos_token_ids=[EOS])
    assert torch.equal(logits, before)


# --- random sampling and its filters ---------------------------------------------------------


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(), [0, 1, 2, 3, 4, 5]),
        (SamplingParams(top_k=2), [0, 1]),
        # ascending cumsum 0.04, 0.10, 0.20 <= 1 - 0.7: the three least likely go.
        (SamplingParams(top_p=0.7), [0, 1, 2]),
        # threshold 0.3 * 0.40 = 0.12 drops 0.10, 0.06, 0.04.
        (SamplingParams(min_p=0.3), [0, 1, 2]),
        # min_p first (vLLM): {0,1,2} renormalised to 0.5, 0.3125, 0.1875; top_p 0.45 keeps {0}
        # (top_p first would keep {0, 1}).
        (SamplingParams(min_p=0.3, top_p=0.45), [0]),
        (SamplingParams(top_k=4, top_p=0.8), [0, 1, 2]),
    ],
)
def test_filters_keep_exactly_what_they_should(params, keep):
    freq = frequencies(params)
    assert torch.allclose(freq, expected(keep), atol=0.02), freq
    dropped = [t for t in range(len(PROBS)) if t not in keep]
    assert freq[dropped].sum() == 0


def test_temperature_reshapes_distribution():
    # temperature 2 -> p ** 0.5 renormalised.
    freq = frequencies(SamplingParams(temperature=2.0))
    target = PROBS.sqrt() / PROBS.sqrt().sum()
    assert torch.allclose(freq, target, atol=0.02), freq


def test_seeded_rows_follow_the_distribution():
    gens = [make_generator(seed, "cpu") for seed in range(4_000)]
    freq = frequencies(SamplingParams(seed=0), generators=gens)  # seed only marks it seeded
    assert torch.allclose(freq, PROBS, atol=0.035), freq


def _run_steps(
    target: SamplingParams, position: int, neighbours: list[SamplingParams], steps: int = 6
) -> tuple[list[int], list[float]]:
    """Decode `steps` tokens for `target` at batch `position` among `neighbours`."""
    vocab = 500
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(123)) * 2
    target_gen = make_generator(target.seed, "cpu")
    others = [make_generator(p.seed, "cpu") for p in neighbours]
    out_tokens: list[int] = []
    logprobs: list[float] = []
    sampler = Sampler()
    for step in range(steps):
        rows = [row(p, prompt=[1, 2], generator=g) for p, g in zip(neighbours, others)]
        rows.insert(position, row(target, prompt=[1, 2], output=out_tokens, generator=target_gen))
        logits = torch.randn(len(rows), vocab)  # neighbours get fresh junk every step
        logits[position] = base + 0.1 * step
        out = sampler(logits, rows, eos_token_ids=[EOS])
        out_tokens.append(int(out.token_ids[position]))
        logprobs.append(float(out.logprobs[position]))
    return out_tokens, logprobs


def test_seeded_request_reproducible_alone_and_in_any_batch():
    target = SamplingParams(seed=42, temperature=0.9, top_p=0.95, repetition_penalty=1.2, logprobs=2)
    alone = _run_steps(target, 0, [])
    neighbours = [
        SamplingParams(),
        SamplingParams(seed=7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=42, min_p=0.1),
    ]
    assert _run_steps(target, 2, neighbours) == alone
    assert _run_steps(target, 4, neighbours[::-1]) == alone
    other_seed = _run_steps(SamplingParams(seed=43, temperature=0.9, top_p=0.95, logprobs=2), 0, [])
    assert other_seed[0] != alone[0]


# --- min_tokens and penalties ----------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 8)
    logits[:, EOS] = 5.0
    logits[:, 6] = 4.0
    logits[:, 1] = 3.0
    greedy = dict(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    rows = [
        row(SamplingParams(**greedy), output=[0]),  # below min_tokens: EOS and 6 masked
        row(SamplingParams(**greedy), output=[0, 0, 0]),  # reached: EOS allowed
        row(SamplingParams(**greedy, ignore_eos=True), output=[0]),  # EOS not a stop: kept
        row(SamplingParams(temperature=0.0)),  # no min_tokens
    ]
    out = Sampler()(logits, rows, eos_token_ids=[EOS])
    assert out.token_ids.tolist() == [1, EOS, EOS, EOS]

    masked = logits.clone()
    apply_min_tokens(masked, rows, eos_token_ids=[EOS])
    assert masked[0, EOS] == -math.inf and masked[0, 6] == -math.inf
    assert masked[2, 6] == -math.inf and masked[2, EOS] == 5.0
    assert torch.equal(masked[1], logits[1])


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 3)
    rows = [
        row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 1],
            output=[2, 2, 3],
        ),
        row(SamplingParams(), prompt=[0, 1], output=[2, 2, 3]),  # no penalties: untouched
        row(SamplingParams(presence_penalty=1.0), prompt=[0, 4], output=[1, 1]),  # output only
    ]
    apply_penalties(logits, rows)
    # row 0: repetition over {0,1,2,3}: 2/2, -1*2, 0.5/2, 3/2; then token 2 (count 2):
    # 0.25 - 0.5*2 - 0.25 = -1.0; token 3 (count 1): 1.5 - 0.5 - 0.25 = 0.75.
    assert logits[0].tolist() == [1.0, -2.0, -1.0, 0.75, -2.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]
    assert logits[2].tolist() == [2.0, -2.0, 0.5, 3.0, -2.0]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=[0, 0])]
    assert Sampler()(logits, rows, eos_token_ids=[]).token_ids.tolist() == [1]


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_shapes_and_raw_values():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    rows = [
        row(SamplingParams(logprobs=3, repetition_penalty=1.5), prompt=[0, 1, 2]),
        row(SamplingParams(logprobs=0, temperature=0.0)),
        row(SamplingParams(top_k=5)),  # asked for none
        row(SamplingParams(logprobs=1, min_tokens=2), output=[4]),
    ]
    out = Sampler()(logits, rows, eos_token_ids=[EOS])
    ref = logits.log_softmax(dim=-1)  # raw: before min_tokens and penalties
    assert out.logprobs.shape == (4,) and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (4, 3)
    ref_values, ref_ids = ref.topk(3, dim=-1)
    assert torch.equal(ids, ref_ids) and torch.allclose(values, ref_values)
    assert torch.isfinite(values).all()  # EOS masked for row 3, but raw logprobs ignore that


def test_penalized_logprobs_and_k_zero():
    torch.manual_seed(2)
    logits = torch.randn(2, 20)
    rows = [
        row(SamplingParams(logprobs=0, repetition_penalty=1.5, temperature=0.7), prompt=[0, 1]),
        row(SamplingParams(logprobs=0, min_tokens=1)),
    ]
    out = Sampler(logprobs_mode="penalized")(logits, rows, eos_token_ids=[EOS])
    processed = logits.clone()
    apply_min_tokens(processed, rows, [EOS])
    apply_penalties(processed, rows)
    ref = processed.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is None  # nobody asked for top logprobs


def test_bad_inputs_rejected():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="processed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [row(SamplingParams())], eos_token_ids=[])
