"""Prefill/decode disaggregation of an MLA model: the latent cache, one plane per block, moves over
NIXL as GQA's keys and values do. The model is DeepSeek-V3.2, DeepSeek-V3's MLA with DeepSeek
Sparse Attention, so each layer's indexer keys move beside its latent (a second layout, of its own
block bytes): the long prompt (past the indexer's top 16) attends sparsely on the decode side
over transferred keys, the short one densely. Greedy outputs through the router equal the
colocated server's, streamed and not."""

from __future__ import annotations

import httpx
import pytest
from disagg_utils import RouterProcess, streamed_text

KV = ("--block-size", "4", "--kv-cache-memory", "32MiB")
PROMPTS = ["Multi-head latent attention keeps one compressed vector per token in its cache.", "Short"]


@pytest.fixture(scope="module")
def mla_deployment(start_server, make_checkpoint, tmp_path_factory):
    checkpoint = make_checkpoint("deepseek_v32", 0)
    both = start_server(*KV, checkpoint=checkpoint, wait=False)
    prefill = start_server("--role", "prefill", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    decoder = start_server("--role", "decode", "--kv-transfer", "nixl", *KV, checkpoint=checkpoint, wait=False)
    for server in (both, prefill, decoder):
        server.wait_healthy()
    router = RouterProcess([prefill.url], [decoder.url], tmp_path_factory.mktemp("router") / "router.log")
    router.wait_listening()
    yield both, decoder, router
    router.stop()
    for server in (both, prefill, decoder):
        server.stop()


def test_mla_outputs_through_the_router_equal_the_colocated_servers(mla_deployment):
    both, decoder, router = mla_deployment
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
        expected = httpx.post(f"{both.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == expected
        assert streamed_text(router.url, "/v1/completions", body) == expected
    metrics = decoder.metrics()
    assert metrics["moeserve:kv_transfer_bytes_total{role=decode}"] > 0
    assert metrics["moeserve:kv_transfer_failures_total{cause=layout,role=decode}"] == 0
