"""The bounds of `moeserve/api/input_bounds.py`: the stop limits, and the character bound on a
prompt that refuses text before it is tokenized, which must never refuse text that would fit."""

from __future__ import annotations

import random
import string

import pytest

from moeserve.api.errors import APIError
from moeserve.api.input_bounds import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    check_prompt_chars,
    check_stop,
    longest_token_chars,
)
from moeserve.engine.tokenizer import load_tokenizer


def test_stop_limits() -> None:
    assert check_stop(None) is None and check_stop("x") == "x"
    assert check_stop(["a"] * MAX_STOP_STRINGS) == ["a"] * MAX_STOP_STRINGS
    with pytest.raises(ValueError, match="at most 32 stop strings"):
        check_stop(["a"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="at most 1024 characters"):
        check_stop("b" * (MAX_STOP_CHARS + 1))


def test_no_text_that_fits_the_context_is_refused(tokenizer_dir) -> None:
    """Texts of every kind (letters, spaces, punctuation, digits, non-ASCII) take at least
    len(text) / longest_token_chars tokens, so a text refused by characters never fits."""
    tokenizer = load_tokenizer(tokenizer_dir)
    longest = longest_token_chars(tokenizer)
    rng = random.Random(0)
    alphabets = [string.ascii_lowercase + " ", string.printable, "ab ", "é漢字 a", "-" * 3 + "=" + " "]
    for alphabet in alphabets:
        for length in (1, 50, 2000):
            text = "".join(rng.choice(alphabet) for _ in range(length))
            tokens = len(tokenizer.encode(text, add_special_tokens=False))
            assert tokens * longest >= len(text), (alphabet, length, tokens, longest)
            check_prompt_chars([text], max_model_len=tokens, token_chars=longest, param="prompt")  # fits: no error
    with pytest.raises(APIError, match="cannot fit") as refused:
        check_prompt_chars(["x" * 101], max_model_len=10, token_chars=10, param="messages")
    assert refused.value.param == "messages"
