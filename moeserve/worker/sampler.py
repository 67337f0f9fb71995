"""The batched sampler: last-position logits of every running request -> one new token each.

Order of operations (vLLM v1's):
  1. logprobs source, if any row asked for logprobs (see `LogprobsMode`);
  2. min_tokens: mask EOS and stop_token_ids while a row is shorter than its min_tokens;
  3. repetition penalty (prompt + output tokens), then frequency and presence (output only);
  4. greedy rows (temperature ~0 or top_k == 1): argmax;
     random rows: temperature -> min_p -> top_k -> top_p -> exponential race.
vLLM applies min_p right after temperature, before top-k/top-p; the order matters because top-p
renormalises over what min_p left. Rows are independent: a row's result depends only on its own
logits, parameters and generator, never on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from moeserve.sampling_params import SamplingParams

LogprobsMode = Literal["raw", "penalized"]
"""Which distribution the returned logprobs describe.

"raw" (default, vLLM v1's default `raw_logprobs`): log_softmax of the model's logits before any
  processing; what RL and scoring want, since it is the model's opinion, not the sampler's.
"penalized": log_softmax after min_tokens masking and penalties but before temperature and the
  top-k/top-p/min-p filters (vLLM v0 reported logprobs after penalties; v0 also applied
  temperature and the filters, which this mode deliberately does not).
"""


@dataclass
class SamplingRow:
    """What the sampler needs to know about one batch row (one running request)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    """The request's own generator (see `make_generator`), kept across steps; None: global RNG."""


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


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    """In place: -inf on EOS (unless ignore_eos) and stop_token_ids of rows below min_tokens.

    logits: `[B, V]` float32.
    """
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        for tok in stop_ids:
            if tok < vocab_size:
                row_idx.append(i)
                tok_idx.append(tok)
    if row_idx:
        logits[row_idx, tok_idx] = float("-inf")


def _seen_pairs(
    token_lists: list[Sequence[int]], row_ids: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs over the given lists, with how often each occurs.

    Penalties touch only tokens a row has seen, so working on these pairs instead of a dense
    `[B, V]` count matrix keeps memory proportional to the tokens, not to B * V.
    Returns rows `[P]`, tokens `[P]` and counts `[P]` (P = distinct pairs), all int64.
    """
    lengths = torch.tensor([len(toks) for toks in token_lists], dtype=torch.int64)
    flat = torch.cat([torch.as_tensor(toks, dtype=torch.int64).reshape(-1) for toks in token_lists])
    owner = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.int64), lengths)
    keys, counts = torch.unique(owner * vocab_size + flat, return_counts=True)  # [P]
    keys, counts = keys.to(device), counts.to(device)
    return keys // vocab_size, keys % vocab_size, counts


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: repetition penalty, then frequency and presence penalties (vLLM's definitions).

    Repetition (over prompt + output): positive logits are divided by the penalty, negative ones
    multiplied. Frequency/presence (over output only, OpenAI's definition):
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    logits: `[B, V]` float32.
    """
    vocab_size = logits.shape[1]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep]
        if any(seen):
            r, t, _ = _seen_pairs(seen, rep, vocab_size, logits.device)
            penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=logits.device)[r]  # [P]
            vals = logits[r, t]  # [P]
            logits[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
    freq = [
        i
        for i, row in enumerate(rows)
        if (row.params.frequency_penalty or row.params.presence_penalty) and len(row.output_token_ids) > 0
    ]
    if freq:
        r, t, counts = _seen_pairs([rows[i].output_token_ids for i in freq], freq, vocab_size, logits.device)
        fp = torch.tensor([row.params.frequency_penalty for row in rows], device=logits.device)
        pp = torch.tensor([row.params.presence_penalty for row in rows], device=logits.device)
        logits[r, t] -= fp[r] * counts + pp[r]


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: -inf where prob < min_p * max prob. logits `[R, V]`, min_p `[R]`."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place: keep tokens >= the k-th largest logit (ties at the k-th all kept, as vLLM).

    logits `[R, V]`; top_k `[R]` int64, 0 = off. One `topk` of the largest k instead of a sort.
    """
    active = top_k > 0  # [R]
    k = torch.where(active, top_k, 1).clamp_max(logits.shape[1])
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
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


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
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


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then the race. logits `[R, V]` (modified); -> `[R]`."""
    device = logits.device
    params = [row.params for row in rows]
    logits.div_(torch.tensor([p.temperature for p in params], device=device).unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        _apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    if any(p.top_k > 0 for p in params):
        _apply_top_k(logits, torch.tensor([p.top_k for p in params], device=device))
    if any(p.top_p < 1 for p in params):
        logits = _apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    return _exponential_race(logits.softmax(dim=-1), [row.generator for row in rows])


class Sampler:
    """Picks one token per batch row, honouring each row's `SamplingParams`.

    Stateless across steps: the per-request state it needs (tokens so far, generator) comes in
    with the rows, so the same sampler serves every batch.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw") -> None:
        if logprobs_mode not in ("raw", "penalized"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'penalized', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        eos_token_ids: Sequence[int],
    ) -> SamplerOutput:
        """Sample the next token of every row.

        logits: `[B, V]`, any float dtype (computed in float32; the input is not modified).
        rows: B rows, in the order of the logits.
        eos_token_ids: the model's EOS ids, masked for rows still below their min_tokens.
        """
        # B = batch rows, V = vocab
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        logprobs_src = None
        if want_logprobs and self.logprobs_mode == "raw":
            logprobs_src = logits.log_softmax(dim=-1)  # [B, V]

        apply_min_tokens(logits, rows, eos_token_ids)
        apply_penalties(logits, rows)
        if want_logprobs and self.logprobs_mode == "penalized":
            logprobs_src = logits.log_softmax(dim=-1)  # [B, V]

        token_ids = self._pick(logits, rows)  # [B]
        if logprobs_src is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        return self._gather_logprobs(logprobs_src, token_ids, rows)

    @staticmethod
    def _pick(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Argmax for greedy rows, random sampling for the rest. logits `[B, V]` -> `[B]` int64."""
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_idx:
            return logits.argmax(dim=-1)
        greedy_idx = [i for i, row in enumerate(rows) if row.params.greedy]
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)  # [B]
        if greedy_idx:
            g = torch.tensor(greedy_idx, device=logits.device)
            token_ids[g] = logits[g].argmax(dim=-1)
        r = torch.tensor(random_idx, device=logits.device)
        token_ids[r] = _sample_random(logits[r], [rows[i] for i in random_idx])
        return token_ids

    @staticmethod
    def _gather_logprobs(logprobs_src: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The sampled tokens' logprobs `[B]` and the top-k `[B, k]` pair from `[B, V]`."""
        sampled = logprobs_src.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
        k = max(row.params.logprobs or 0 for row in rows)
        top = None
        if k > 0:
            values, ids = logprobs_src.topk(k, dim=-1)  # [B, k] each
            top = (ids, values)
        return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_logprobs=top)
