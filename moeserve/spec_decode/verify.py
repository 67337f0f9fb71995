"""Greedy verification of draft tokens: keep each draft the target model would have picked itself.

The target's forward over `[last token, d1 .. dk]` gives at row i the logits of the token after
d_i (row 0: after the last token). Draft d_{i+1} is kept while every earlier one was and it is
row i's argmax, so the kept drafts are exactly what greedy decoding would have produced one step
at a time (the forward is batch invariant: a row's logits do not depend on how many tokens share
the step), and row `num_accepted` gives the next token on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
