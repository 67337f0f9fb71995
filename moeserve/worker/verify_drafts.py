"""Verification of draft tokens: greedy sequences keep each draft the target would have picked
itself; sampled ones keep drafts by rejection sampling, which leaves the target's distribution as
it was.

The target's forward over `[last token, d1 .. dk]` gives at row i the logits of the token after
d_i (row 0: after the last token). Draft d_{i+1} is kept while every earlier one was and it is
row i's argmax, so the kept drafts are exactly what greedy decoding would have produced one step
at a time (the forward is batch invariant: a row's logits do not depend on how many tokens share
the step), and row `num_accepted` gives the next token on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeserve.ops.host_ints import int64_tensor
from moeserve.worker.sampler import sample_from

TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]
"""A token's logprob and the top ones at its position, (token id, logprob) most likely first."""


def accept_greedy(logits: torch.Tensor, drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """For sequences whose rows sit one after another in `logits [R, V]` (sequence j has
    `len(drafts[j]) + 1` rows): the row each one samples its next token from, and how many of its
    drafts it keeps. One host sync for the whole batch."""
    predicted = logits.argmax(dim=-1).tolist()  # [R]; exact on any float dtype, ties to the first
    rows, accepted = [], []
    first = 0
    for draft in drafts:
        kept = 0
        while kept < len(draft) and predicted[first + kept] == draft[kept]:
            kept += 1
        rows.append(first + kept)
        accepted.append(kept)
        first += len(draft) + 1
    return rows, accepted


def rejection_sample(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling of one sequence whose drafts came from a point mass (n-gram): keep
    draft i with probability p_i(d_i), and at the first rejection sample from p_i without d_i
    (renormalised), or after every draft kept from the last row. The emitted tokens are then
    distributed exactly as sampling one token at a time from the target (Leviathan et al., with
    q = the draft's point mass). probs `[k + 1, V]`: row i the target's sampling distribution
    after the sequence's tokens and d_1..d_i. Draws from `generator` (the request's, for a
    seeded request; None: the global one): k uniforms, then one token. -> (drafts kept, token)."""
    k = len(draft)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    draft_probs = probs[torch.arange(k, device=probs.device), torch.tensor(draft, device=probs.device)].tolist()
    kept = 0
    while kept < k and uniforms[kept] < draft_probs[kept]:
        kept += 1
    row = probs[kept : kept + 1].clone()  # [1, V]
    if kept < k:
        row[0, draft[kept]] = 0.0
    return kept, int(sample_from(row, [generator])[0])


def verified_logprobs(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """The logprobs of tokens verified at rows of `logits [R, V]` (a kept draft, or the token
    rejection sampling drew), as the sampler reports a sampled token's (log_softmax of the
    float32 logits, grammar masks already on them): `token_ids[i]` at row `rows[i]`, the row it
    would have been sampled from one step at a time. `num_top[i]`: how many top logprobs its
    request asked for."""
    if not rows:
        return []
    source = logits[int64_tensor(rows).to(logits.device)].float().log_softmax(dim=-1)  # [D, V]
    chosen = source.gather(1, int64_tensor(token_ids).to(logits.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top)
    top_values, top_ids = source.topk(k, dim=-1) if k else (None, None)  # [D, k] each
    top = list(zip(top_ids.tolist(), top_values.tolist())) if top_ids is not None else []
    return [
        (logprob, tuple(zip(top[i][0][:n], top[i][1][:n])) if n else ())
        for i, (logprob, n) in enumerate(zip(chosen, num_top))
    ]
