"""What the sampler needs for one step, as tensors: built by `InputBatch`, read by `Sampler.sample`.

Every choice the host can make without looking at device values is made when the metadata is
built (which rows are greedy, whether any row filters by top-k, the largest k, how many logprobs
to return), so sampling a step reads no device value back before the tokens themselves.

B = rows sampled this step, V = vocabulary, R = rows sampled at random, P = penalised rows,
M = (row, token) pairs masked by min_tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What sampling needs to know about one request: the stateless sampler's row, and what
    `InputBatch.add` takes for a new request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    """The request's own generator (see `make_generator`), kept across steps; None: global RNG."""


@dataclass(frozen=True)
class RandomRows:
    """The rows that sample at random (temperature above ~0 and top_k != 1), with their filters."""

    index: torch.Tensor | None
    """`[R]` int64 batch rows; None when every row samples at random."""
    temperature: torch.Tensor
    """`[R]` float32."""
    top_k: torch.Tensor | None
    """`[R]` int64, 0 = off; None when no row filters by top-k."""
    max_top_k: int
    """The largest top_k among the rows (0 when top_k is None), so top-k needs no device read."""
    top_p: torch.Tensor | None
    """`[R]` float32; None when every row keeps top_p = 1."""
    min_p: torch.Tensor | None
    """`[R]` float32; None when every row keeps min_p = 0."""
    generators: tuple[torch.Generator | None, ...]
    """R entries: each seeded row's own generator, None for rows that draw from the global one."""


@dataclass(frozen=True)
class PenaltyRows:
    """The rows with a repetition, frequency or presence penalty, and what they have seen."""

    index: torch.Tensor
    """`[P]` int64 batch rows."""
    output_counts: torch.Tensor
    """`[P, V]` float32: how often each token occurs among the row's output tokens."""
    prompt_seen: torch.Tensor | None
    """`[P, V]` bool: the token occurs in the prompt; None when no row has a repetition penalty."""
    repetition: torch.Tensor | None
    """`[P]` float32 (1 = off); None when no row has one."""
    frequency: torch.Tensor
    """`[P]` float32."""
    presence: torch.Tensor
    """`[P]` float32."""


@dataclass(frozen=True)
class MaskedTokens:
    """(row, token) pairs set to -inf: EOS and stop tokens of rows still below their min_tokens."""

    rows: torch.Tensor
    """`[M]` int64."""
    token_ids: torch.Tensor
    """`[M]` int64."""


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's sampling parameters for B rows, in the order of the logits' rows."""

    num_rows: int
    random: RandomRows | None
    """None: every row is greedy (argmax)."""
    penalties: PenaltyRows | None
    min_tokens: MaskedTokens | None
    num_logprobs: tuple[int | None, ...]
    """B entries: the logprobs each row asked for (0: the sampled token's only; None: none)."""
    max_num_logprobs: int | None
    """The most logprobs any row asked for; None when no row asked."""
    slots: torch.Tensor
    """`[B]` int64 host tensor: the `InputBatch` slot of each row, so the batch can record the
    sampled tokens."""


@dataclass(frozen=True)
class AllowedTokens:
    """The grammar's word on some rows: which tokens they may sample next, 32 to an int32 word
    (token t is allowed when bit t % 32 of word t // 32 is set, xgrammar's layout)."""

    rows: torch.Tensor
    """`[K]` int64 batch rows."""
    bitmask: torch.Tensor
    """`[K, ceil(V / 32)]` int32."""


@dataclass(frozen=True)
class TokenBitmask:
    """One step's grammar bitmask, by request: made in the engine core, where the grammar
    matchers live, and shipped with the plan to whichever process samples."""

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor
    """`[K, ceil(V / 32)]` int32 on the host: each request's rows in turn, `num_rows` of them."""
    num_rows: tuple[int, ...] = ()
    """Rows per request (empty: one each). A sequence verifying k n-gram drafts has k + 1: row i
    allows what may follow its drafts 1..i (speculative decoding)."""

    def for_rows(
        self, request_ids: Sequence[str], device: torch.device | str, num_rows: Sequence[int] | None = None
    ) -> AllowedTokens | None:
        """The rows of a batch sampling `request_ids` (in that order; `num_rows[j]` consecutive
        rows for request j, None: one each) that this mask covers."""
        counts = self.num_rows or (1,) * len(self.request_ids)
        starts = itertools.accumulate(counts, initial=0)
        index = {request_id: (start, n) for request_id, start, n in zip(self.request_ids, starts, counts)}
        pairs, row = [], 0
        for j, request_id in enumerate(request_ids):
            n = 1 if num_rows is None else num_rows[j]
            if request_id in index:
                start, masks = index[request_id]
                if masks != n:
                    raise ValueError(f"{request_id} samples from {n} rows, its grammar mask has {masks}")
                pairs += [(row + i, start + i) for i in range(n)]
            row += n
        if not pairs:
            return None
        rows, masks = zip(*pairs)
        bitmask = self.bitmask if list(masks) == list(range(self.bitmask.shape[0])) else self.bitmask[list(masks)]
        return AllowedTokens(torch.tensor(rows, dtype=torch.int64, device=device), bitmask.to(device))


class PendingBitmask:
    """A step's grammar bitmask that may still be filling while the forward runs.

    The engine core starts the fill before it hands the plan over and the sampler waits for it
    only once the logits exist, so the fill (the matchers walking their grammars) costs the step
    nothing unless it outlasts the forward. Where the forward runs in rank processes, the core
    sends the mask after the plan, and each rank reads it when it samples."""

    def __init__(self, take: Callable[[], TokenBitmask]) -> None:
        self._take = take  # blocks until the mask is there: a fill's result, or a message read
        self._mask: TokenBitmask | None = None

    def get(self) -> TokenBitmask:
        """The mask, waiting for it if it is not there yet."""
        if self._mask is None:
            self._mask = self._take()
        return self._mask

    def settle(self) -> None:
        """Wait until the mask is there or its fill failed: a step that failed drops it, but
        must not leave the fill running."""
        try:
            self.get()
        except Exception:  # noqa: BLE001 - the step's own failure is the one that matters
            pass
