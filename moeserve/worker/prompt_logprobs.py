"""Prompt logprobs: the logprob of each prompt token given the tokens before it (vLLM's
`prompt_logprobs`, and what `echo` + `logprobs` reports for the prompt).

A prefill computes hidden states for every prompt position, but the runner turns only the last
row of a sequence into logits. For the requests that ask, this also projects the rows of their
prefill chunks: position p's logits give the logprob of prompt token p + 1. Each chunk adds its
positions; a request that is preempted and recomputed runs its prompt again, and the positions it
already reported are skipped, so every prompt token is reported exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeserve.scheduler import ScheduledRequest

ROWS_PER_PASS = 512
"""Rows projected to the vocabulary at once: a long prefill chunk times a large vocabulary in
float32 would otherwise hold gigabytes of logits."""


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprobs of consecutive prompt tokens `start`, `start + 1`, ... (start >= 1: the first
    prompt token has nothing before it), from one prefill chunk."""

    start: int
    logprobs: list[float]
    """The prompt token's logprob at each position."""
    ranks: list[int]
    """Its rank among the vocabulary (1 = most likely), as vLLM reports it."""
    top: list[list[tuple[int, float]]]
    """The `num_top` most likely tokens at each position, most likely first: (token id, logprob)."""

    def followed_by(self, later: PromptLogprobs) -> PromptLogprobs:
        """These positions and the next chunk's, which must start where these end."""
        if later.start != self.end:
            raise ValueError(f"prompt logprobs from {later.start} do not follow those up to {self.end}")
        return PromptLogprobs(
            self.start, self.logprobs + later.logprobs, self.ranks + later.ranks, self.top + later.top
        )

    @property
    def end(self) -> int:
        """One past the last prompt token covered."""
        return self.start + len(self.logprobs)


@dataclass
class _Wanted:
    num_top: int
    prompt: tuple[int, ...]
    reported: int = 0
    """Positions whose next token's logprob was already reported (0 .. len(prompt) - 1)."""


class PromptLogprobsTracker:
    """The requests that asked for prompt logprobs, and how far each has been reported."""

    def __init__(self) -> None:
        self._wanted: dict[str, _Wanted] = {}

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def add(self, request_id: str, num_top: int | None, prompt_token_ids: Sequence[int]) -> None:
        """Track a new request; one that did not ask (num_top None) is ignored."""
        if num_top is not None:
            self._wanted[request_id] = _Wanted(num_top, tuple(prompt_token_ids))

    def remove(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)

    def compute(
        self,
        parts: Sequence[Sequence[ScheduledRequest]],
        hiddens: Sequence[torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, PromptLogprobs]:
        """The logprobs this step's prefill chunks add; `hiddens[i]` holds `parts[i]`'s packed
        rows (one per scheduled token, in order)."""
        result = {}
        for part, hidden in zip(parts, hiddens):
            begins = itertools.accumulate((len(s.token_ids) for s in part), initial=0)
            for scheduled, begin in zip(part, begins):
                wanted = self._wanted.get(scheduled.request_id)
                if wanted is None:
                    continue
                first = max(scheduled.start_position, wanted.reported)
                end = min(scheduled.start_position + len(scheduled.token_ids), len(wanted.prompt) - 1)
                if first >= end:
                    continue
                rows = hidden[begin + first - scheduled.start_position : begin + end - scheduled.start_position]
                targets = torch.tensor(wanted.prompt[first + 1 : end + 1], dtype=torch.int64, device=hidden.device)
                result[scheduled.request_id] = _logprobs(rows, targets, wanted.num_top, first + 1, compute_logits)
                wanted.reported = end
        return result


def _logprobs(
    rows: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    start: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PromptLogprobs:
    """Log-softmax (float32) of each row's logits, read at its target token and its top ones."""
    logprobs, ranks, top = [], [], []
    for i in range(0, rows.shape[0], ROWS_PER_PASS):
        log_probs = compute_logits(rows[i : i + ROWS_PER_PASS]).float().log_softmax(dim=-1)  # [n, V]
        chosen = log_probs.gather(1, targets[i : i + ROWS_PER_PASS, None])  # [n, 1]
        logprobs += chosen[:, 0].tolist()
        ranks += ((log_probs > chosen).sum(dim=-1) + 1).tolist()
        if num_top > 0:
            values, ids = log_probs.topk(num_top, dim=-1)
            top += [list(zip(i_row, v_row)) for i_row, v_row in zip(ids.tolist(), values.tolist())]
        else:
            top += [[] for _ in range(chosen.shape[0])]
    return PromptLogprobs(start, logprobs, ranks, top)
