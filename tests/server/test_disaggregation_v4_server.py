"""Prefill/decode disaggregation of DeepSeek-V4 (a window of 8, entries of 4 and of 16 positions:
at block 4 a hit resumes every 64 positions): a 150-token prompt moves up to its mark, 128, as
each group's blocks a hit there reads and the open windows' state saved there; the decode
instance resumes from them as from a prefix-cache hit and computes the last 22 positions. Its
greedy tokens equal the prefill instance's own colocated run of the prompt from scratch (whose
cache the routed prefill then resumes from, holding what it found), and afterwards neither side
holds, pins or moves a block."""

from __future__ import annotations

import httpx
from disagg_utils import disaggregated, wait_idle

KV = ("--block-size", "4", "--kv-cache-memory", "32MiB")


def test_v4_outputs_through_disaggregation_equal_a_colocated_run(start_server, make_checkpoint):
    checkpoint = make_checkpoint("deepseek_v4")
    prefill = start_server("--role", "prefill", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    decoder = start_server("--role", "decode", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    for server in (prefill, decoder):
        server.wait_healthy()
    prompt = [3 + (7 * i) % 300 for i in range(150)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    colocated = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    routed = disaggregated(prefill.url, decoder.url, body)["choices"][0]["text"]
    assert routed == colocated
    metrics = decoder.metrics()
    assert metrics["moeserve:kv_transfer_bytes_total{role=decode}"] > 0
    assert sum(v for k, v in metrics.items() if k.startswith("moeserve:kv_transfer_failures_total")) == 0
    assert metrics["moeserve:prefix_cache_hits_total"] == 128  # the loaded prefix, never computed here
    wait_idle(prefill, decoder)
    for server in (prefill, decoder):
        server.stop()
