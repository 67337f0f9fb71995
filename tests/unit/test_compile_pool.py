"""The grammar compile pool's cache (`structured/compile_pool.py`): a spec that is invalid is
refused from the cache when it comes again, but one whose compile ran out of time is compiled
again by the next request (the timeout said something about the load of that moment, not about
the spec), and each timeout is counted."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.hf_configs import VOCAB

from moeserve.engine.tokenizer import load_tokenizer
from moeserve.engine_config import StructuredOutputsConfig
from moeserve.sampling_params import StructuredOutputs
from moeserve.structured.compile_pool import CompileRefusedError, GrammarCompilePool

SLOW = StructuredOutputs("regex", "[a-z]?" * 300)
"""Compiles for about a second here: past a 0.1 s timeout, well within 60 s."""
INVALID = StructuredOutputs("regex", "(unclosed")


@pytest.fixture
def timeouts() -> list[float]:
    """When the pool's `on_timeout` was called."""
    return []


@pytest.fixture
def pool(tokenizer_dir: Path, timeouts: list[float]):
    config = StructuredOutputsConfig(compile_workers=1, compile_timeout_s=0.1)
    on_timeout = lambda: timeouts.append(time.monotonic())  # noqa: E731
    pool = GrammarCompilePool(config, load_tokenizer, str(tokenizer_dir), VOCAB, [0], on_timeout=on_timeout)
    yield pool
    pool.shutdown()


def test_a_timed_out_compile_is_not_cached_and_the_next_request_compiles_it(
    pool: GrammarCompilePool, timeouts: list[float]
) -> None:
    with pytest.raises(CompileRefusedError, match="--structured-outputs-compile-timeout"):
        pool.submit(SLOW, "a").result(timeout=60)
    assert pool.stats()["timeouts"] == 1 and len(timeouts) == 1
    assert pool.stats()["cached"] == 0

    # The load has passed (here: the limit is raised): the same spec compiles on the next request
    # instead of being refused from the cache.
    pool.config = replace(pool.config, compile_timeout_s=60.0)
    grammar = pool.submit(SLOW, "a").result(timeout=60)
    assert grammar.startswith("{") and pool.stats()["cached"] == 1
    assert pool.submit(SLOW, "b").result(timeout=0) == grammar  # now from the cache
    assert pool.stats()["timeouts"] == 1 and len(timeouts) == 1


def test_an_invalid_spec_is_cached_and_refused_again_without_a_compile(pool: GrammarCompilePool) -> None:
    pool.config = replace(pool.config, compile_timeout_s=60.0)
    with pytest.raises(CompileRefusedError) as first:
        pool.submit(INVALID, "a").result(timeout=60)
    assert pool.stats()["cached"] == 1
    again = pool.submit(INVALID, "a")
    assert again.done()  # settled from the cache at once: no job queued
    with pytest.raises(CompileRefusedError) as second:
        again.result(timeout=0)
    assert str(second.value) == str(first.value)
    assert pool.stats()["timeouts"] == 0
