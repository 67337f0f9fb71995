"""Bounds on request fields whose cost grows with what a client sends, so that one request cannot
take time that belongs to everyone else's.

Each bound is checked before the work it protects:

* stop strings are searched on every output token of every sample (the detokenizer scans a window
  as long as the longest stop string, once per string), so their number and length are capped;
* stop token ids are kept per sample for the whole request;
* a prompt is tokenized (and a conversation rendered) on the server's one prompt thread, which
  every request waits on: text with more characters than the context can hold in tokens is
  refused before any of that runs. The bound is exact, not a guess: no token of the vocabulary
  spells more characters than the longest one does, so a text longer than `max_model_len` times
  that length cannot fit in `max_model_len` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from moeserve.api.errors import APIError

MAX_STOP_STRINGS = 32  # OpenAI allows 4; vLLM sets no limit
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """The `stop` field, refused past `MAX_STOP_STRINGS` strings or `MAX_STOP_CHARS` characters."""
    strings = [stop] if isinstance(stop, str) else (stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    longest = max((len(s) for s in strings), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
    return stop


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token of the vocabulary spells (a byte-level token's string
    has one character per byte, so it bounds the decoded text's characters too)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1)


def check_prompt_chars(texts: Iterable[str], max_model_len: int, token_chars: int, param: str) -> None:
    """400 before tokenizing when `texts` together cannot fit in the context whatever they say."""
    total = sum(len(t) for t in texts)
    if total > max_model_len * token_chars:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, and no token spells more than "
            f"{token_chars} characters, so {total} characters of {param} cannot fit. Please reduce the length "
            "of the input.",
            param=param,
            code="context_length_exceeded",
        )
