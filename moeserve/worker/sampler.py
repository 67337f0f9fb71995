"""The batched sampler: last-position logits of every sampled request -> one new token each.

Order of operations (vLLM v1's):
  0. the grammar's bitmask, for rows under structured outputs: disallowed tokens to -inf (vLLM
     applies it to the logits before its sampler, so its logprobs see it too);
  1. logprobs source, if any row asked for logprobs (see `LogprobsMode`);
  2. min_tokens: mask EOS and stop_token_ids while a row is shorter than its min_tokens;
  3. repetition penalty (prompt + output tokens), then frequency and presence (output only);
  4. greedy rows (temperature ~0 or top_k == 1): argmax;
     random rows: temperature -> min_p -> top_k -> top_p -> exponential race.
vLLM applies min_p right after temperature, before top-k/top-p; the order matters because top-p
renormalises over what min_p left. Rows are independent: a row's result depends only on its own
logits, parameters and generator, never on what else is in the batch.

Every step works on tensors (`SamplingMetadata`), never row by row in Python; the one loop left
is over seeded rows, each drawing its noise from its own generator. The runner's `InputBatch`
keeps that metadata across steps; `Sampler.__call__` and the `apply_*` functions take plain
`SamplingRow`s instead, building the same metadata through a throwaway batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from moeserve.worker.input_batch import InputBatch
from moeserve.worker.sampling_metadata import (
    AllowedTokens,
    MaskedTokens,
    PenaltyRows,
    RandomRows,
    SamplingMetadata,
    SamplingRow,
)

LogprobsMode = Literal["raw", "penalized"]
"""Which distribution the returned logprobs describe.

"raw" (default, vLLM v1's default `raw_logprobs`): log_softmax of the model's logits before any
  processing; what RL and scoring want, since it is the model's opinion, not the sampler's.
"penalized": log_softmax after min_tokens masking and penalties but before temperature and the
  top-k/top-p/min-p filters (vLLM v0 reported logprobs after penalties; v0 also applied
  temperature and the filters, which this mode deliberately does not).
"""


@dataclass
class SamplerOutput:
    """The tokens picked for a batch, and the logprobs the rows asked for.

    token_ids: `[B]` int64, one new token per row.
    logprobs: `[B]` float32 logprob of each sampled token; None when no row asked for logprobs.
        Rows that did not ask still get a value (it is cheaper than masking them out).
    top_logprobs: (ids `[B, k]` int64, values `[B, k]` float32), sorted by descending logprob,
        with k the largest `logprobs` asked for in the batch; a row that asked for fewer reads
        its first ones. None when k == 0.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for `seed` on `device`, or None for an unseeded request.

    Made once when the request is admitted and kept for its whole life, so its random stream
    advances step by step exactly as it would if the request ran alone.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def metadata_for_rows(
    rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int], device: torch.device | str
) -> SamplingMetadata:
    """The metadata of a one-off batch holding these rows, in order (no state outlives the call)."""
    batch = InputBatch(vocab_size, eos_token_ids, device, capacity=max(len(rows), 1))
    ids = [str(i) for i in range(len(rows))]
    batch.add(ids, rows)
    return batch.sampling_metadata([batch.slot(i) for i in ids])


def mask_tokens(logits: torch.Tensor, masked: MaskedTokens | None) -> None:
    """In place: -inf at the masked (row, token) pairs. logits `[B, V]`."""
    if masked is not None:
        logits.index_put_((masked.rows, masked.token_ids), logits.new_tensor(float("-inf")))


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens | None) -> None:
    """In place: -inf on every token the grammar forbids in the constrained rows. logits `[B, V]`.

    Each int32 word unpacks to its 32 bits with one shift and mask, so a row costs `V` boolean
    ops on the logits' device and nothing per token in Python.
    """
    if allowed is None:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    words = allowed.bitmask.to(logits.device)  # [K, W]
    bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]  # [K, V], 1 = allowed
    rows = logits.index_select(0, allowed.rows).masked_fill_(bits == 0, float("-inf"))  # [K, V]
    logits.index_copy_(0, allowed.rows, rows)


def penalize(logits: torch.Tensor, penalties: PenaltyRows | None) -> None:
    """In place: repetition penalty, then frequency and presence penalties (vLLM's definitions).

    Repetition (over prompt + output): positive logits are divided by the penalty, negative ones
    multiplied. Frequency/presence (over output only, OpenAI's definition):
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    logits: `[B, V]` float32; only the P penalised rows are read and written.
    """
    if penalties is None:
        return
    rows = logits.index_select(0, penalties.index)  # [P, V]
    counts = penalties.output_counts  # [P, V]
    output_seen = counts > 0
    if penalties.repetition is not None:
        seen = output_seen | penalties.prompt_seen
        penalty = penalties.repetition.unsqueeze(1)  # [P, 1]
        rows = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    rows -= penalties.frequency.unsqueeze(1) * counts + penalties.presence.unsqueeze(1) * output_seen
    logits.index_copy_(0, penalties.index, rows)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    """In place: -inf on EOS (unless ignore_eos) and stop_token_ids of rows below min_tokens.

    logits: `[B, V]` float32.
    """
    mask_tokens(logits, metadata_for_rows(rows, logits.shape[1], eos_token_ids, logits.device).min_tokens)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: `penalize` for plain rows (their prompt and output tokens counted here).

    logits: `[B, V]` float32.
    """
    penalize(logits, metadata_for_rows(rows, logits.shape[1], (), logits.device).penalties)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: -inf where prob < min_p * max prob. logits `[R, V]`, min_p `[R]`."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """In place: keep tokens >= the k-th largest logit (ties at the k-th all kept, as vLLM).

    logits `[R, V]`; top_k `[R]` int64, 0 = off; max_top_k: its largest value, known on the host.
    One `topk` of the largest k instead of a sort.
    """
    active = top_k > 0  # [R]
    k = torch.where(active, top_k, 1).clamp_max(logits.shape[1])
    kth = logits.topk(min(max_top_k, logits.shape[1]), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    kth.masked_fill_(~active.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one).

    logits `[R, V]`, top_p `[R]`; returns the filtered logits `[R, V]`.
    """
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [R, V]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row: argmax(probs / E), E ~ Exp(1) i.i.d. (same law as multinomial).

    Each seeded row draws its V exponentials from its own generator, so its result does not
    depend on its batch neighbours; unseeded rows share one draw from the global generator.
    probs `[R, V]`; returns `[R]` int64.
    """
    noise = torch.empty_like(probs)  # [R, V]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    else:
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            shared = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)  # [U, V]
            noise[idx] = shared.exponential_()
    # Exp(1) can return exactly 0; the clamp keeps 0 / 0 (a filtered token) from becoming NaN.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def random_probs(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """The distribution random rows sample from: temperature, min_p, top_k, top_p, softmax.
    logits `[R, V]` float32 (modified); -> `[R, V]`. Speculative decoding verifies drafts
    against it."""
    logits.div_(random.temperature.unsqueeze(1))
    if random.min_p is not None:
        _apply_min_p(logits, random.min_p)
    if random.top_k is not None:
        _apply_top_k(logits, random.top_k, random.max_top_k)
    if random.top_p is not None:
        logits = _apply_top_p(logits, random.top_p)
    return logits.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs [R, V]` (unnormalised is fine), each seeded row from its own
    generator; -> `[R]` int64."""
    return _exponential_race(probs, generators)


def _sample_random(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """`random_probs`, then the race. logits `[R, V]` (modified); -> `[R]`."""
    return _exponential_race(random_probs(logits, random), random.generators)


def _check_rows(logits: torch.Tensor, num_rows: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {num_rows} rows")


class Sampler:
    """Picks one token per batch row, honouring each row's sampling parameters.

    Stateless across steps: what a request has seen (token counts, generator) comes in with the
    metadata, so the same sampler serves every batch.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw") -> None:
        if logprobs_mode not in ("raw", "penalized"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'penalized', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        eos_token_ids: Sequence[int],
    ) -> SamplerOutput:
        """`sample` for plain rows, in the order of the logits; eos_token_ids: the model's EOS
        ids, masked for rows still below their min_tokens."""
        _check_rows(logits, len(rows))
        return self.sample(logits, metadata_for_rows(rows, logits.shape[1], eos_token_ids, logits.device))

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, allowed: AllowedTokens | None = None
    ) -> SamplerOutput:
        """Sample the next token of every row; `allowed`: the grammar's bitmask for the rows under
        structured outputs (None: no row is constrained).

        logits: `[B, V]`, any float dtype (computed in float32; the input is not modified).
        """
        # B = batch rows, V = vocab
        _check_rows(logits, metadata.num_rows)
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        apply_allowed_tokens(logits, allowed)
        want_logprobs = metadata.max_num_logprobs is not None
        logprobs_src = None
        if want_logprobs and self.logprobs_mode == "raw":
            logprobs_src = logits.log_softmax(dim=-1)  # [B, V]

        mask_tokens(logits, metadata.min_tokens)
        penalize(logits, metadata.penalties)
        if want_logprobs and self.logprobs_mode == "penalized":
            logprobs_src = logits.log_softmax(dim=-1)  # [B, V]

        token_ids = self._pick(logits, metadata.random)  # [B]
        if logprobs_src is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        return self._gather_logprobs(logprobs_src, token_ids, metadata.max_num_logprobs or 0)

    @staticmethod
    def _pick(logits: torch.Tensor, random: RandomRows | None) -> torch.Tensor:
        """Argmax for greedy rows, random sampling for the rest. logits `[B, V]` (modified) -> `[B]` int64."""
        if random is None:
            return logits.argmax(dim=-1)
        if random.index is None:
            return _sample_random(logits, random)
        token_ids = logits.argmax(dim=-1)  # [B]; the random rows' are overwritten
        token_ids[random.index] = _sample_random(logits[random.index], random)
        return token_ids

    @staticmethod
    def _gather_logprobs(logprobs_src: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
        """The sampled tokens' logprobs `[B]` and the top-k `[B, k]` pair from `[B, V]`."""
        sampled = logprobs_src.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
        top = None
        if k > 0:
            values, ids = logprobs_src.topk(k, dim=-1)  # [B, k] each
            top = (ids, values)
        return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_logprobs=top)
