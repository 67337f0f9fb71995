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

    The latest occurrence, because a sequence that loops repeats its most recent period. This is
    the search by its definition, a scan back through the whole sequence for each n: the
    specification `NgramProposer` (which the scheduler runs) is held to, and its benchmark's
    baseline.
    """
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n :])
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and list(token_ids[start : start + n]) == suffix:
                return _continue(token_ids, start + n, num_tokens)
    return []


_BULK_TOKENS = 8
"""From this many tokens on, `NgramProposer.extend` files them n by n over the whole run."""
_TOKEN_BITS = 32
"""Bits per token in an n-gram's key: token ids are below 2**32 (vocabularies are far smaller)."""


class NgramProposer:
    """One sequence's prompt-lookup drafts, proposed at a cost that does not grow with its length.

    It keeps, for each n in [min_n, max_n], where every n-gram of the sequence last ended, filed
    as the tokens arrive (each token once). A proposal is then at most one look-up per n of the
    sequence's last n tokens, where a scan (`propose_ngram`) reads the whole sequence for each n
    whenever nothing matches, the usual case on ordinary text. It proposes exactly what
    `propose_ngram` does over the same tokens. An n-gram is filed as one int (its tokens' bits
    side by side), not a tuple: about 40% less memory (some 400 bytes per token of context at the
    default five sizes of n, the price of the constant cost), and dicts of ints only, which the
    garbage collector never has to walk.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._latest_end: list[dict[int, int]] = [{} for _ in range(min_n, max_n + 1)]
        """By n - min_n: each n-gram's key -> the end (exclusive) of its latest occurrence that is
        not the sequence's own suffix, i.e. ends up to len(tokens) - 1."""

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence read so far."""
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Read the sequence's next tokens. Each n-gram is filed once the token after it has
        arrived, so the sequence's current suffix is never its own earlier occurrence; a later
        occurrence replaces an earlier one. A decode's few tokens are filed one by one; a prompt
        chunk's n by n over the whole run (each n's keys from the n - 1's, in comprehensions),
        about 3x faster a token but with a fixed cost a single token would pay several times over."""
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) >> _TOKEN_BITS == 0):
            raise ValueError(f"token ids must lie in [0, 2**{_TOKEN_BITS})")
        tokens = self._tokens
        if len(token_ids) < _BULK_TOKENS:
            for token_id in token_ids:
                end = len(tokens)
                for key, latest in zip(self._suffix_keys(end)[self.min_n - 1 :], self._latest_end):
                    latest[key] = end
                tokens.append(token_id)
            return
        first_end = len(tokens)
        tokens.extend(token_ids)
        last_end = len(tokens) - 1  # the newest suffix is filed when the next token comes
        ends = list(range(first_end, last_end + 1))  # one int object per end, shared by every n
        keys: list[int] = []  # the (n - 1)-grams' keys, for the ends from `start` on
        start = first_end
        for n in range(1, self.max_n + 1):
            n_start = max(first_end, n)  # an n-gram ends n tokens into the sequence at the earliest
            if n_start > last_end:
                break
            column = tokens[n_start - n : last_end - n + 1]  # each n-gram's first token
            shift = _TOKEN_BITS * (n - 1)
            keys = column if n == 1 else [key | token << shift for key, token in zip(keys[n_start - start :], column)]
            start = n_start
            if n >= self.min_n:
                self._latest_end[n - self.min_n].update(zip(keys, ends[start - first_end :]))

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow the tokens read so far (as `propose_ngram`).

        The longest match is sought upwards from min_n: a suffix seen before ended, that time
        too, in each of its own shorter suffixes, so the first n that was never seen ends the
        search (on ordinary text after a look-up or two), and the last n found is the longest."""
        length = len(self._tokens)
        follow = None
        for key, latest in zip(self._suffix_keys(length)[self.min_n - 1 : length - 1], self._latest_end):
            end = latest.get(key)
            if end is None:
                break
            follow = end
        return [] if follow is None else _continue(self._tokens, follow, num_tokens)

    def _suffix_keys(self, end: int) -> list[int]:
        """The keys of the n-grams ending at `end` (exclusive), for n = 1, 2, ... up to max_n: the
        last token in the low bits, each earlier one `_TOKEN_BITS` higher, so that within one n,
        equal keys are equal n-grams."""
        keys, key = [], 0
        for n in range(1, min(self.max_n, end) + 1):
            key |= self._tokens[end - n] << (_TOKEN_BITS * (n - 1))
            keys.append(key)
        return keys


def _continue(token_ids: Sequence[int], follow: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `follow` on; a match close to the end runs on into the
    drafts themselves, as a sequence repeating with a short period goes on repeating it. Reads
    only the tokens it copies, however far back the match is."""
    extended = list(token_ids[follow : follow + num_tokens])
    for i in range(num_tokens - len(extended)):
        extended.append(extended[i])
    return extended
