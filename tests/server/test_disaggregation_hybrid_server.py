"""Prefill/decode disaggregation of a Gated DeltaNet hybrid (Qwen3.5-MoE: 3 DeltaNet layers and 1
full attention): the attention layer's blocks and each DeltaNet layer's state saved at the
prompt's last full block move over NIXL, and the decode instance resumes from them as from a
prefix-cache hit; greedy outputs through the router equal a single instance's."""

from __future__ import annotations

import httpx
import pytest
from disagg_utils import RouterProcess, streamed_text

KV = ("--block-size", "4", "--kv-cache-memory", "32MiB")
PROMPTS = ["Gated DeltaNet layers keep one fixed-size state per sequence, whatever its length.", "Short"]


@pytest.fixture(scope="module")
def hybrid_deployment(start_server, make_checkpoint, tmp_path_factory):
    checkpoint = make_checkpoint("qwen3_5_moe")
    prefill = start_server("--role", "prefill", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    decoder = start_server("--role", "decode", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    for server in (prefill, decoder):
        server.wait_healthy()
    router = RouterProcess([prefill.url], [decoder.url], tmp_path_factory.mktemp("router") / "router.log")
    router.wait_listening()
    yield prefill, decoder, router
    router.stop()
    for server in (prefill, decoder):
        server.stop()


def test_hybrid_outputs_through_the_router_equal_a_single_instances(hybrid_deployment):
    """The reference is the prefill instance serving a plain request (no transfer) before any
    routed one, so it computes every prompt from scratch; the routed runs' prefill steps then
    resume from the states it saved, and the decode instance from the states it is sent."""
    prefill, decoder, router = hybrid_deployment
    bodies = [{"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0} for prompt in PROMPTS]
    expected = [
        httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        for body in bodies
    ]
    for body, text in zip(bodies, expected, strict=True):
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == text
    metrics = decoder.metrics()
    assert metrics["moeserve:kv_transfer_bytes_total{role=decode}"] > 0
    assert sum(v for k, v in metrics.items() if k.startswith("moeserve:kv_transfer_failures_total")) == 0
    # The decode instance never computed these prompts: its hits are the loaded states resumed from.
    assert metrics["moeserve:prefix_cache_hits_total"] > 0
    for body, text in zip(bodies, expected, strict=True):
        assert streamed_text(router.url, "/v1/completions", body) == text
