"""Prefill/decode disaggregation end to end on CPU, with real NIXL transfers over loopback: a
prefill instance at --ep 1 and a decode instance at --ep 2 (its KV cache in the rank processes)
behind `moeserve router`, and a prefill instance at --ep 2 (its ranks push) behind a second router
to the same decode instance, against a colocated server on the same checkpoint."""

from __future__ import annotations

from typing import NamedTuple

import httpx
import pytest
from disagg_utils import RouterProcess, decode, kv_info, streamed_text, wait_idle
from server_utils import metric_samples

KV = ("--block-size", "4", "--kv-cache-memory", "32MiB")
DISAGG = ("--kv-transfer", "nixl", *KV)
SYSTEM = "You are a careful assistant who answers in short sentences about foxes and dogs. "
PROMPTS = [SYSTEM + "Tell me what the quick brown fox did next.", SYSTEM + "And the lazy dog?", "Short one, eh"]
# Prompts the decode instance has not cached yet, so that every block crosses from the --ep 2 prefill.
WIDE_PROMPTS = ["Once upon a time a wide prefill instance held its cache in two ranks.", "Each rank pushed its own."]


class Deployment(NamedTuple):
    both: object
    prefill: object
    decoder: object
    router: RouterProcess
    wide_prefill: object
    """At --ep 2: each data-parallel group's KV cache is in its rank's process, which pushes it."""
    wide_router: RouterProcess


@pytest.fixture(scope="module")
def deployment(start_server, tmp_path_factory):
    both = start_server(*KV, wait=False)
    prefill = start_server("--role", "prefill", *DISAGG, wait=False)
    decoder = start_server("--role", "decode", "--ep", "2", *DISAGG, wait=False)
    wide_prefill = start_server("--role", "prefill", "--ep", "2", *DISAGG, wait=False)
    servers = (both, prefill, decoder, wide_prefill)
    for server in servers:
        server.wait_healthy()
    logs = tmp_path_factory.mktemp("router")
    router = RouterProcess([prefill.url], [decoder.url], logs / "router.log")
    wide_router = RouterProcess([wide_prefill.url], [decoder.url], logs / "wide_router.log")
    router.wait_listening()
    wide_router.wait_listening()
    yield Deployment(both, prefill, decoder, router, wide_prefill, wide_router)
    for r in (router, wide_router):
        r.stop()
    for server in servers:
        server.stop()


def _completion(url: str, prompt: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_router_outputs_equal_the_colocated_servers(deployment):
    both, prefill, decoder, router = deployment[:4]
    for prompt in PROMPTS:
        expected = _completion(both.url, prompt)["choices"][0]["text"]
        assert _completion(router.url, prompt)["choices"][0]["text"] == expected
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
        assert streamed_text(router.url, "/v1/completions", body) == expected
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{both.url}/v1/chat/completions", json=chat, timeout=120).json()
    routed = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120).json()
    assert routed["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert streamed_text(router.url, "/v1/chat/completions", chat) == expected["choices"][0]["message"]["content"]
    assert httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"

    decoded = decoder.metrics()
    assert decoded["moeserve:kv_transfer_bytes_total{role=decode}"] > 0
    assert decoded["moeserve:kv_transfer_seconds_count{role=decode}"] >= 4
    # The decode side computed only the last partial block of each transferred prompt.
    assert decoded["moeserve:prefix_cache_hits_total"] > decoded["moeserve:prefix_cache_queries_total"] / 2
    assert prefill.metrics()["moeserve:kv_transfer_bytes_total{role=prefill}"] > 0

    routed_metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert f'moeserve_router:requests_total{{instance="{prefill.url}",role="prefill"}}' in routed_metrics
    assert "moeserve_router:ttft_decode_seconds_count" in routed_metrics


def test_the_router_splits_ttft_by_phase(deployment):
    both, router = deployment.both, deployment.router
    phases = ("prefill_queue", "prefill", "transfer", "first_decode_step")
    before = metric_samples(router.url)
    prompt = PROMPTS[0] + " Twice."
    answer = _completion(router.url, prompt, max_tokens=4)
    assert "kv_transfer_params" not in answer  # the instances' timings stay with the router
    assert answer["choices"] == _completion(both.url, prompt, max_tokens=4)["choices"]
    streamed_text(router.url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4})
    after = metric_samples(router.url)
    added = {p: after[f"moeserve_router:ttft_phase_seconds_count{{phase={p}}}"] for p in phases}
    added = {p: n - before[f"moeserve_router:ttft_phase_seconds_count{{phase={p}}}"] for p, n in added.items()}
    assert added == dict.fromkeys(phases, 2)
    spent = {p: after[f"moeserve_router:ttft_phase_seconds_sum{{phase={p}}}"] for p in phases}
    assert spent["prefill"] > 0 and spent["first_decode_step"] > 0
    # Every routed request reported its phases: they fit within the TTFTs the router timed.
    assert sum(spent.values()) <= after["moeserve_router:ttft_seconds_sum"]


def test_a_prefill_instance_at_ep_2_pushes_from_its_ranks(deployment):
    both, wide_prefill, decoder, wide_router = (
        deployment.both,
        deployment.wide_prefill,
        deployment.decoder,
        deployment.wide_router,
    )
    pushed_before = decoder.metrics()["moeserve:kv_transfer_seconds_count{role=decode}"]
    for prompt in WIDE_PROMPTS:
        expected = _completion(both.url, prompt)["choices"][0]["text"]
        assert _completion(wide_router.url, prompt)["choices"][0]["text"] == expected
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
        assert streamed_text(wide_router.url, "/v1/completions", body) == expected
    assert decoder.metrics()["moeserve:kv_transfer_seconds_count{role=decode}"] >= pushed_before + 2 * len(WIDE_PROMPTS)
    pushed = wide_prefill.metrics()
    assert pushed["moeserve:kv_transfer_bytes_total{role=prefill}"] > 0
    assert sum(v for k, v in pushed.items() if k.startswith("moeserve:kv_transfer_failures_total")) == 0
    wait_idle(wide_prefill, decoder)


def test_blocks_go_back_on_both_sides(deployment):
    _completion(deployment.router.url, PROMPTS[1])
    wait_idle(deployment.prefill, deployment.decoder)


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        ({"model": "0" * 16}, "different model"),
        ({"block_size": 8}, "different block size (8, here 4)"),
        ({"tp": 2}, "mixed tensor parallelism is refused"),
    ],
)
def test_bad_handshakes_are_refused_clearly(deployment, claim, message):
    prefill, decoder = deployment.prefill, deployment.decoder
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4}
    response = decode(decoder.url, "/v1/completions", body, "never-prefilled", {**kv_info(prefill.url), **claim})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert "KV handshake refused" in error["message"] and message in error["message"]


def test_the_router_refuses_more_than_one_choice_clearly(deployment):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 2, "n": 2}
    response = httpx.post(f"{deployment.router.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "n") and "n = 1 only" in error["message"]


def test_transfer_params_need_a_disaggregated_instance(deployment, tmp_path):
    both, prefill, decoder = deployment[:3]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"transfer_id": "x"}}
    response = httpx.post(f"{both.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and "--role prefill or decode" in response.json()["error"]["message"]
    assert httpx.get(f"{both.url}/kv/info", timeout=10).status_code == 404
    # A router given the instances the wrong way round refuses to start, saying so.
    router = RouterProcess([decoder.url], [prefill.url], tmp_path / "router.log")
    try:
        assert router.proc.wait(180) == 2
    finally:
        router.stop()
    assert "was given as --prefill but runs --role decode" in (tmp_path / "router.log").read_text()
