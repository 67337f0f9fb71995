"""Incremental detokenization: the Rust stream and the Python offsets give the same text."""

from __future__ import annotations

import random

import pytest

from moeserve.checkpoints import demo_model_path
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(demo_model_path())


class Refusing:
    """A Rust stream that refuses from the `after`-th token on, as on an invalid prefix."""

    def __init__(self, stream, after: int) -> None:
        self.stream, self.calls, self.after = stream, 0, after

    def step(self, backend, token_id: int):
        self.calls += 1
        if self.calls > self.after:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(backend, token_id)


def python_only(tokenizer, **kwargs) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    detok._stream = None
    return detok


def test_rust_stream_and_python_offsets_agree(tokenizer) -> None:
    """Random ids of a byte-level vocabulary split multi-byte characters across tokens; both
    ways must wait for the same characters and end with the tokenizer's own decode."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(64)]
        fast, slow = IncrementalDetokenizer(tokenizer), python_only(tokenizer)
        assert fast._stream is not None
        texts = []
        for token_id in ids:
            fast.append(token_id)
            slow.append(token_id)
            texts.append(fast.text)
            assert fast.text == slow.text
        assert tokenizer.decode(ids, skip_special_tokens=True).startswith(fast.text)  # a last partial character waits
        assert any(a == b for a, b in zip(texts, texts[1:])), "no token waited for the rest of a character"


def test_a_refusing_rust_stream_goes_on_in_python(tokenizer) -> None:
    rng = random.Random(1)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(64)]
    detok = IncrementalDetokenizer(tokenizer)
    detok._stream = Refusing(detok._stream, after=30)
    for token_id in ids:
        detok.append(token_id)
    assert detok._stream is None
    slow = python_only(tokenizer)
    for token_id in ids:
        slow.append(token_id)
    assert detok.text == slow.text and tokenizer.decode(ids, skip_special_tokens=True).startswith(detok.text)


def test_stop_strings_cut_the_text(tokenizer) -> None:
    ids = tokenizer.encode(" alpha beta gamma delta")
    for keep in (False, True):
        detok = IncrementalDetokenizer(tokenizer, stop=["gam"], include_stop_str_in_output=keep)
        stop = next(stop for t in ids if (stop := detok.append(t)) is not None)
        assert stop == "gam"
        assert detok.text == (" alpha beta gam" if keep else " alpha beta ")
