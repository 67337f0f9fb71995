"""Prompt-lookup (n-gram) drafts: text that repeats itself (code, quotes of the prompt, lists)
predicts its own continuation. Pure Python over the scheduler's token lists."""

from __future__ import annotations

from collections.abc import Sequence

from moeserve.sampling_params import SamplingParams


def can_draft(params: SamplingParams, method: str = "ngram") -> bool:
    """Whether a sequence's drafts can be verified exactly, by the argmax (greedy) or by rejection
    sampling, against the distribution the sampler would use at each draft position: penalties
    and min_tokens are applied per position (the drafts before it counted as output), logprobs
    come from the verify forward's row of each kept draft, and a grammar is followed draft by
    draft (the engine core walks it over the drafts for each position's mask), so only over
    drafts known before the forward (n-gram, not MTP's), and not under ignore_eos, where a draft
    that completes the grammar would have tokens follow it. Other sequences decode one token per
    step beside the speculating ones.
    """
    return params.structured_outputs is None or (method == "ngram" and not params.ignore_eos)


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` drafts: what followed the latest earlier occurrence of the sequence's
    last n tokens, for the largest n in [min_n, max_n] that occurs earlier; [] when none does.

    The latest occurrence, because a sequence that loops repeats its most recent period; scanning
    backwards stops at the first match, so a repetitive sequence costs little.
    """
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n :])
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and list(token_ids[start : start + n]) == suffix:
                return _continue(token_ids, start + n, num_tokens)
    return []


def _continue(token_ids: Sequence[int], follow: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `follow` on; a match close to the end runs on into the
    drafts themselves, as a sequence repeating with a short period goes on repeating it."""
    extended = list(token_ids[follow:])
    for i in range(num_tokens - len(extended)):
        extended.append(extended[i])
    return extended[:num_tokens]
