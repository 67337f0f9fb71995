"""Rejection sampling of n-gram drafts keeps the target's distribution: over many draws on a
small vocabulary, the emitted tokens follow the target's law whether the drafts are likely,
unlikely or impossible, and a seeded generator gives the same draws again."""

from __future__ import annotations

import torch

from moeserve.worker.verify_drafts import rejection_sample

# A 2-step target on 5 tokens: p(x1) and p(x2 | x1 = 3), the only history the drafts below follow.
P1 = torch.tensor([0.1, 0.2, 0.05, 0.5, 0.15])
P2_AFTER_3 = torch.tensor([0.3, 0.0, 0.4, 0.1, 0.2])
P3 = torch.tensor([0.2] * 5)  # after (3, 2): uniform


def draws(draft: list[int], n: int, seed: int) -> list[tuple[int, ...]]:
    """The first emitted tokens (kept drafts, then the sampled one) of `n` verifications."""
    probs = torch.stack([P1, P2_AFTER_3, P3])[: len(draft) + 1]
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        kept, token = rejection_sample(probs, draft, generator)
        out.append((*draft[:kept], token))
    return out


def total_variation(samples: list[int], law: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(law)).float()
    return 0.5 * float((counts / counts.sum() - law).abs().sum())


def test_emitted_tokens_follow_the_target_whatever_the_drafts():
    n = 10000
    for draft in ([3, 2], [1, 1], [4, 0], [3]):
        out = draws(draft, n, seed=len(draft) + draft[0])
        assert total_variation([o[0] for o in out], P1) < 0.02, draft
        if draft[0] == 3:  # the second token, given the first was 3: p(. | 3), never token 1
            second = [o[1] for o in out if o[0] == 3 and len(o) > 1]
            assert len(second) > 0.45 * n and total_variation(second, P2_AFTER_3) < 0.025, draft


def test_a_seeded_generator_reproduces_the_draws():
    assert draws([3, 2], 200, seed=7) == draws([3, 2], 200, seed=7)
    assert draws([3, 2], 200, seed=7) != draws([3, 2], 200, seed=8)
