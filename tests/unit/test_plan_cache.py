"""`moeserve plan --cache-per-sequence`: Qwen3.5-35B-A3B beside Qwen3-30B-A3B from their layers'
cache specs, checked by hand against the released configs' dimensions."""

from __future__ import annotations

import pytest

from moeserve.cli import main
from moeserve.plan.cache import CONTEXTS, cache_table, sequence_cache
from moeserve.plan.shapes import load_config, load_shape


def test_qwen3_5_beside_qwen3_by_hand():
    hybrid, dense = (sequence_cache(*load_config(name)) for name in ("qwen3.5-35b-a3b", "qwen3-30b-a3b"))
    assert hybrid.bytes_per_token == 10 * 2 * 2 * 256 * 2  # attention layers x (K, V) x KV heads x head dim x bf16
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2  # q, k, v channels x (kernel - 1) x bf16
    recurrent = 32 * 128 * 128 * 4  # value heads x Dk x Dv x float32
    assert hybrid.state_bytes == 30 * (conv + recurrent)
    assert (dense.bytes_per_token, dense.state_bytes) == (48 * 2 * 4 * 128 * 2, 0)
    for model in (hybrid, dense):
        assert model.at_context == tuple(n * model.bytes_per_token + model.state_bytes for n in CONTEXTS)
    rows = [line.split() for line in cache_table([hybrid, dense]).splitlines()]
    assert rows[2] == ["state,", "whatever", "the", "length", "61.4", "MiB", "-"]
    assert rows[3:6] == [
        ["1k", "tokens", "81.4", "MiB", "96", "MiB"],
        ["32k", "tokens", "701", "MiB", "3072", "MiB"],
        ["128k", "tokens", "2621", "MiB", "12288", "MiB"],
    ]
    assert rows[6][-3:] == ["61.4", "MiB", "-"]  # a saved state of prefix caching


def test_the_command_prints_the_table_and_the_search_refuses_hybrids(capsys):
    assert main(["plan", "--cache-per-sequence", "qwen3.5-35b-a3b", "qwen3-30b-a3b"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == [
        "cache",
        "per",
        "sequence",
        "qwen3.5-35b-a3b",
        "qwen3-30b-a3b",
    ]
    with pytest.raises(ValueError, match="--cache-per-sequence"):
        load_shape("qwen3.5-35b-a3b")
    assert main(["plan", "--gpus", "8"]) == 2
