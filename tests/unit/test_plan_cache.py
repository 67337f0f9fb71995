"""`moeserve plan --cache-per-sequence`: Qwen3.5-35B-A3B beside Qwen3-30B-A3B, and DeepSeek-V4-Flash
beside DeepSeek-V3, from their layers' cache specs, checked by hand against the released
configs' dimensions."""

from __future__ import annotations

import torch

from moeserve.cli import main
from moeserve.plan.cache import CONTEXTS, cache_table, sequence_cache
from moeserve.plan.shapes import load_config


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
    assert rows[3] == ["state,", "whatever", "the", "length", "61.4", "MiB", "-"]
    assert rows[4:12:2] == [
        ["1k", "tokens", "81.4", "MiB", "96", "MiB"],
        ["32k", "tokens", "701", "MiB", "3072", "MiB"],
        ["128k", "tokens", "2621", "MiB", "12.0", "GiB"],
        ["1M", "tokens", "20.1", "GiB", "96.0", "GiB"],
    ]
    assert rows[7] == ["per", "token", "at", "32k", "21.9", "KiB", "96", "KiB"]
    assert rows[12][-3:] == ["61.4", "MiB", "-"]  # a saved state of prefix caching


def test_deepseek_v4_flash_beside_v3_by_hand():
    """V4-Flash as released: 43 layers of a 512-wide shared-KV head, 2 window-only (compress ratio
    0), 21 CSA (4) with 128-wide indexer keys, 20 HCA (128); a window of 128; bf16, blocks of 16."""
    config, _ = load_config("deepseek-v4-flash")
    ratios = config.compressed_attention.compress_ratios
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (2, 21, 20)
    v4, v3 = sequence_cache(config, "flash"), sequence_cache(*load_config("deepseek-v3"))
    row, index_key = 512 * 2, 128 * 2  # a position's (or an entry's) key, an indexer key
    assert v4.bytes_per_token == 21 * (row + index_key) / 4 + 20 * row / 128
    assert v4.window_bytes == 43 * (128 + 16) * row  # the last 128 positions span 9 blocks when they start mid-block
    csa_state = 2 * 3 * 1024 * 2 + 4 * 512 * (2 + 4)  # pending values, gates (2 x 512 wide); carried Ca, gates
    csa_state += 2 * 3 * 256 * 2 + 4 * 128 * (2 + 4)  # the indexer's compressor alike, 128 wide
    hca_state = 2 * 127 * 512 * 2  # pending values and gates of up to 127 positions
    assert v4.state_bytes == 21 * csa_state + 20 * hca_state
    for n, got in zip(CONTEXTS, v4.at_context, strict=True):
        window = 43 * 128 * row  # every context here is a multiple of 16 and over 128: 8 whole blocks
        csa = 21 * -(-(n // 4) // 16) * 16 * (row + index_key)
        hca = 20 * -(-(n // 128) // 16) * 16 * row
        assert got == window + csa + hca + v4.state_bytes
    assert v4.at_context[2] == 5_636_096 + 21 * 2048 * 16 * 1280 + 20 * 64 * 16 * 1024 + 5_847_040  # 128k
    assert v3.at_context == tuple(n * 61 * (512 + 64) * 2 for n in CONTEXTS)
    assert v3.at_context[-1] / v4.at_context[-1] > 10  # 1M tokens: a tenth of V3's cache


def test_a_saved_state_costs_what_the_engine_allocates_for_one():
    """Prefix caching keeps saved states for V4 (its open compression windows) as for a hybrid
    (its DeltaNet states): the table's figure is what the engine's budget sets aside for one
    saved state and what its allocation holds for one."""
    from moeserve.models.decoder import cache_specs
    from moeserve.models.v4.cache import allocate
    from moeserve.worker.kv_cache import state_bytes

    for name in ("deepseek-v4-flash", "qwen3.5-35b-a3b"):
        config, _ = load_config(name)
        table = sequence_cache(config, name)
        assert table.state_bytes > 0
        assert state_bytes(config, torch.bfloat16, 0, saved_states=1) == table.state_bytes
    config, _ = load_config("deepseek-v4-flash")
    specs = cache_specs(config, torch.bfloat16)
    pools = dict.fromkeys(specs.groups, 1)
    saved = [allocate(layer, pools, 16, 0, "meta", num_saved=1).saved for layer in specs.layers]
    assert sum(t.numel() * t.element_size() for layer in saved for t in layer) == sequence_cache(config, "").state_bytes
    rows = [line.split() for line in cache_table([sequence_cache(config, "flash")]).splitlines()]
    assert rows[12] == ["saved", "state", "(prefix", "caching),", "each", "5.6", "MiB"]


def test_the_command_prints_the_table(capsys):
    assert main(["plan", "--cache-per-sequence", "deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["cache", "per", "sequence", "deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v3"]
    assert lines[10].split() == ["1M", "tokens", "6891", "MiB", "9864", "MiB", "68.6", "GiB"]
    assert main(["plan", "--gpus", "8"]) == 2
