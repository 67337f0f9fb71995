"""The runner's persistent batch: every live request's sampling state, kept across steps.

A request takes a slot when the plan that first schedules it arrives and keeps it until its id
comes back finished (through preemption too), as vLLM v1's InputBatch. Its parameters are
written once, into host tensors indexed by slot; each step touches only what changed:

- the output lengths of rows below a min_tokens (one vectorised add on the host) and,
  for rows with a penalty, their output token counts (one scatter-add on the device into a
  `[P, V]` pool, so penalties never rebuild counts from token lists);
- the step's `SamplingMetadata` is gathered from the slots when the set of sampling slots
  changes, and reused while the same slots sample in the same order (every decode step between
  two admissions or finishes); only the penalty counts and the min_tokens mask are re-read.

N = slots (capacity), B = rows of a step, V = vocabulary, P = penalised requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.sampling_params import SamplingParams
from moeserve.worker.sampling_metadata import MaskedTokens, PenaltyRows, RandomRows, SamplingMetadata, SamplingRow


class _PenaltyPool:
    """Device rows `[P, V]` of output counts and prompt masks, one per live request with a
    penalty; requests without one cost nothing."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [P, V]
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [P, V]
        self._free: list[int] = []

    def take(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        """A cleared row holding these tokens."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        device = self.output_counts.device
        self.output_counts[row].zero_()
        self.prompt_seen[row].zero_()
        if prompt_token_ids:
            self.prompt_seen[row, torch.as_tensor(prompt_token_ids, dtype=torch.int64).to(device)] = True
        if output_token_ids:
            ids = torch.as_tensor(output_token_ids, dtype=torch.int64).to(device)
            self.output_counts[row].index_add_(0, ids, torch.ones(len(ids), device=device))
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(4, 2 * old)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
        self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(new - old, self.vocab_size)])
        self._free.extend(range(new - 1, old - 1, -1))  # pop() hands out the lowest row first


@dataclass(frozen=True)
class _Penalised:
    """The penalised rows of a slot set: batch rows `[P]`, their pool rows `[P]`, parameters."""

    index: torch.Tensor
    pool_rows: torch.Tensor
    repetition: torch.Tensor | None
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass(frozen=True)
class _MinTokens:
    """Rows with a min_tokens and something to mask: batch rows `[M]`, their slots `[M]`, their
    min_tokens `[M]` and stop ids `[M, S]` (-1 padded), all on the host."""

    rows: torch.Tensor
    slots: torch.Tensor
    min_tokens: torch.Tensor
    stop_ids: torch.Tensor


@dataclass(frozen=True)
class _SlotSet:
    """What a set of sampling slots fixes until a request joins or leaves."""

    key: tuple[int, ...]
    slots: torch.Tensor
    random: RandomRows | None
    penalised: _Penalised | None
    min_tokens: _MinTokens | None
    num_logprobs: tuple[int | None, ...]
    max_num_logprobs: int | None


class InputBatch:
    """Sampling state of the live requests, by slot. Host tensors `[N]` hold each slot's
    parameters; a freed slot's entries are stale until a new request overwrites them."""

    def __init__(
        self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device | str, capacity: int = 8
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._generators: list[torch.Generator | None] = []
        self._pool = _PenaltyPool(vocab_size, self.device)
        self._slot_set: _SlotSet | None = None
        # Per-slot parameters [N] (float32 unless noted), grown by doubling.
        self._temperature = torch.empty(0)
        self._top_p = torch.empty(0)
        self._min_p = torch.empty(0)
        self._repetition = torch.empty(0)
        self._frequency = torch.empty(0)
        self._presence = torch.empty(0)
        self._top_k = torch.empty(0, dtype=torch.int64)
        self._greedy = torch.empty(0, dtype=torch.bool)
        self._logprobs = torch.empty(0, dtype=torch.int64)  # -1: none asked
        self._min_tokens = torch.empty(0, dtype=torch.int64)
        self._num_output = torch.empty(0, dtype=torch.int64)  # tokens sampled so far (min_tokens rows only)
        self._penalty_row = torch.empty(0, dtype=torch.int64)  # pool row, -1: no penalty
        self._stop_ids = torch.empty(0, 1, dtype=torch.int64)  # [N, S] masked below min_tokens, -1 padded
        self._grow(capacity)

    @property
    def request_ids(self) -> list[str]:
        return list(self._slot_of)

    def slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def is_greedy(self, request_id: str) -> bool:
        """Whether the request picks the argmax (temperature ~0 or top_k 1)."""
        return bool(self._greedy[self._slot_of[request_id]])

    def slots(self, request_ids: Sequence[str]) -> list[int]:
        slot_of = self._slot_of
        return [slot_of[request_id] for request_id in request_ids]

    def add(self, request_ids: Sequence[str], rows: Sequence[SamplingRow]) -> None:
        """Give each request a slot and write its parameters, column by column. A row's generator
        is the request's own (seeded) one, kept for its whole life; its output tokens are those
        sampled before it came here (none for a new request)."""
        if len(request_ids) != len(rows):
            raise ValueError(f"{len(request_ids)} request ids for {len(rows)} rows")
        taken = [request_id for request_id in request_ids if request_id in self._slot_of]
        if taken or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request {(taken or list(request_ids))[0]!r} would hold two slots")
        if not rows:
            return
        while len(self._free) < len(rows):
            self._grow(2 * len(self._generators))
        slots = [self._free.pop() for _ in rows]
        index = torch.tensor(slots, dtype=torch.int64)
        params = [row.params for row in rows]
        for column, values, dtype in (
            (self._temperature, [p.temperature for p in params], torch.float32),
            (self._top_p, [p.top_p for p in params], torch.float32),
            (self._min_p, [p.min_p for p in params], torch.float32),
            (self._repetition, [p.repetition_penalty for p in params], torch.float32),
            (self._frequency, [p.frequency_penalty for p in params], torch.float32),
            (self._presence, [p.presence_penalty for p in params], torch.float32),
            (self._top_k, [p.top_k for p in params], torch.int64),
            (self._greedy, [p.greedy for p in params], torch.bool),
            (self._logprobs, [-1 if p.logprobs is None else p.logprobs for p in params], torch.int64),
            (self._min_tokens, [p.min_tokens for p in params], torch.int64),
            (self._num_output, [len(row.output_token_ids) for row in rows], torch.int64),
        ):
            column[index] = torch.tensor(values, dtype=dtype)
        self._penalty_row[index] = -1
        self._stop_ids[index] = -1
        for request_id, slot, row in zip(request_ids, slots, rows):
            self._slot_of[request_id] = slot
            self._generators[slot] = row.generator
            p = row.params
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                prompt_seen = row.prompt_token_ids if p.repetition_penalty != 1.0 else ()
                self._penalty_row[slot] = self._pool.take(prompt_seen, row.output_token_ids)
            if p.min_tokens:
                self._set_stop_ids(slot, p)
        self._slot_set = None

    def remove(self, request_id: str) -> None:
        """Free the request's slot; an id this batch does not hold is ignored."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            return
        if self._penalty_row[slot] >= 0:
            self._pool.release(int(self._penalty_row[slot]))
        self._generators[slot] = None
        self._free.append(slot)
        self._slot_set = None

    def sampling_metadata(self, slots: Sequence[int]) -> SamplingMetadata:
        """The sampler's tensors for rows holding these slots, in this order."""
        key = tuple(slots)
        if self._slot_set is None or self._slot_set.key != key:
            self._slot_set = self._build_slot_set(key)
        fixed = self._slot_set
        return SamplingMetadata(
            num_rows=len(key),
            random=fixed.random,
            penalties=self._penalty_rows(fixed.penalised),
            min_tokens=self._masked_tokens(fixed.min_tokens),
            num_logprobs=fixed.num_logprobs,
            max_num_logprobs=fixed.max_num_logprobs,
            slots=fixed.slots,
        )

    def record(self, metadata: SamplingMetadata, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled for `metadata`'s rows (`[B]` int64, on the device)."""
        fixed = self._slot_set
        if fixed is None or fixed.slots is not metadata.slots:
            raise ValueError("record() takes the metadata of the last sampling_metadata() call")
        if fixed.min_tokens is not None:  # only min_tokens reads the output lengths
            self._num_output[fixed.min_tokens.slots] += 1
        penalised = fixed.penalised
        if penalised is not None:
            ones = torch.ones(len(penalised.index), device=self.device)
            key = (penalised.pool_rows, token_ids[penalised.index])
            self._pool.output_counts.index_put_(key, ones, accumulate=True)

    def verify_metadata(self, slots: Sequence[int], drafts_before: Sequence[Sequence[int]]) -> SamplingMetadata:
        """The sampler's tensors for the rows of a verify forward (speculative decoding): row r
        holds slot `slots[r]` after its drafts `drafts_before[r]`, which its penalties count as
        output tokens and its min_tokens as tokens generated, as if they had been sampled."""
        metadata = self.sampling_metadata(slots)
        fixed = self._slot_set
        ahead = torch.tensor([len(d) for d in drafts_before], dtype=torch.int64)  # [R] host
        penalties = metadata.penalties
        if penalties is not None:
            pairs = [(p, t) for p, r in enumerate(penalties.index.tolist()) for t in drafts_before[r]]
            if pairs:
                counts = penalties.output_counts.clone()  # [P, V]
                key = torch.tensor(pairs, dtype=torch.int64, device=self.device).T
                counts.index_put_((key[0], key[1]), torch.ones(len(pairs), device=self.device), accumulate=True)
                penalties = dataclasses.replace(penalties, output_counts=counts)
        min_tokens = self._masked_tokens(fixed.min_tokens, ahead)
        return dataclasses.replace(metadata, penalties=penalties, min_tokens=min_tokens)

    def record_drafts(self, slot: int, token_ids: Sequence[int]) -> None:
        """Count drafts a sequence kept (speculative decoding) as sampled tokens: they precede the
        token sampled after them, whose penalties and min_tokens must see them."""
        if not token_ids:
            return
        if self._min_tokens[slot] > 0:  # only min_tokens reads the output lengths
            self._num_output[slot] += len(token_ids)
        pool_row = int(self._penalty_row[slot])
        if pool_row >= 0:
            ids = torch.as_tensor(list(token_ids), dtype=torch.int64).to(self.device)
            self._pool.output_counts[pool_row].index_add_(0, ids, torch.ones(len(ids), device=self.device))

    # ----- building -----

    def _build_slot_set(self, key: tuple[int, ...]) -> _SlotSet:
        slots = torch.tensor(key, dtype=torch.int64)  # [B] host
        num_logprobs = tuple(None if n < 0 else n for n in self._logprobs[slots].tolist())
        return _SlotSet(
            key=key,
            slots=slots,
            random=self._random_rows(slots),
            penalised=self._penalised(slots),
            min_tokens=self._min_tokens_rows(slots),
            num_logprobs=num_logprobs,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=None),
        )

    def _random_rows(self, slots: torch.Tensor) -> RandomRows | None:
        rows = (~self._greedy[slots]).nonzero().squeeze(1)  # [R] host
        if len(rows) == 0:
            return None
        chosen = slots[rows]
        top_k, top_p, min_p = self._top_k[chosen], self._top_p[chosen], self._min_p[chosen]
        max_top_k = int(top_k.max())
        return RandomRows(
            index=None if len(rows) == len(slots) else rows.to(self.device),
            temperature=self._temperature[chosen].to(self.device),
            top_k=top_k.to(self.device) if max_top_k > 0 else None,
            max_top_k=max_top_k,
            top_p=top_p.to(self.device) if bool((top_p < 1).any()) else None,
            min_p=min_p.to(self.device) if bool((min_p > 0).any()) else None,
            generators=tuple(self._generators[s] for s in chosen.tolist()),
        )

    def _penalised(self, slots: torch.Tensor) -> _Penalised | None:
        pool_rows = self._penalty_row[slots]
        rows = (pool_rows >= 0).nonzero().squeeze(1)  # [P] host
        if len(rows) == 0:
            return None
        chosen = slots[rows]
        repetition = self._repetition[chosen]
        return _Penalised(
            index=rows.to(self.device),
            pool_rows=pool_rows[rows].to(self.device),
            repetition=repetition.to(self.device) if bool((repetition != 1).any()) else None,
            frequency=self._frequency[chosen].to(self.device),
            presence=self._presence[chosen].to(self.device),
        )

    def _min_tokens_rows(self, slots: torch.Tensor) -> _MinTokens | None:
        min_tokens = self._min_tokens[slots]
        rows = ((min_tokens > 0) & (self._stop_ids[slots, 0] >= 0)).nonzero().squeeze(1)  # [M] host
        if len(rows) == 0:
            return None
        chosen = slots[rows]
        return _MinTokens(rows, chosen, min_tokens[rows], self._stop_ids[chosen])

    # ----- per step -----

    def _penalty_rows(self, penalised: _Penalised | None) -> PenaltyRows | None:
        """The penalised rows with their counts as of now (the pool changes every step)."""
        if penalised is None:
            return None
        pool = self._pool
        return PenaltyRows(
            index=penalised.index,
            output_counts=pool.output_counts.index_select(0, penalised.pool_rows),
            prompt_seen=None if penalised.repetition is None else pool.prompt_seen.index_select(0, penalised.pool_rows),
            repetition=penalised.repetition,
            frequency=penalised.frequency,
            presence=penalised.presence,
        )

    def _masked_tokens(self, rows: _MinTokens | None, ahead: torch.Tensor | None = None) -> MaskedTokens | None:
        """EOS and stop ids of the rows still below their min_tokens, from host counts alone;
        `ahead [R]`: tokens each batch row has generated beyond them (drafts before it)."""
        if rows is None:
            return None
        generated = self._num_output[rows.slots] + (0 if ahead is None else ahead[rows.rows])
        below = generated < rows.min_tokens  # [M] host
        if not bool(below.any()):
            return None
        stop_ids = rows.stop_ids[below]  # [M', S]
        row_ids = rows.rows[below].unsqueeze(1).expand_as(stop_ids)
        valid = stop_ids >= 0
        return MaskedTokens(row_ids[valid].to(self.device), stop_ids[valid].to(self.device))

    def _set_stop_ids(self, slot: int, params: SamplingParams) -> None:
        """The ids min_tokens masks: stop_token_ids and, unless ignore_eos, EOS (inside the vocab)."""
        masked = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            masked.update(self.eos_token_ids)
        ids = sorted(t for t in masked if t < self.vocab_size)
        if len(ids) > self._stop_ids.shape[1]:
            pad = self._stop_ids.new_full((self._stop_ids.shape[0], len(ids) - self._stop_ids.shape[1]), -1)
            self._stop_ids = torch.cat([self._stop_ids, pad], dim=1)
        self._stop_ids[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int64)

    def _grow(self, capacity: int) -> None:
        old = len(self._generators)
        capacity = max(capacity, old + 1)
        for name in (
            "_temperature",
            "_top_p",
            "_min_p",
            "_repetition",
            "_frequency",
            "_presence",
            "_top_k",
            "_greedy",
            "_logprobs",
            "_min_tokens",
            "_num_output",
            "_penalty_row",
            "_stop_ids",
        ):
            column = getattr(self, name)
            grown = column.new_zeros((capacity, *column.shape[1:]))
            grown[:old] = column
            setattr(self, name, grown)
        self._stop_ids[old:] = -1
        self._generators.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))  # pop() hands out the lowest slot first
