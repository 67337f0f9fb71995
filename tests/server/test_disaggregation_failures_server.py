"""Prefill/decode disaggregation when a transfer fails, with real NIXL over loopback: a decode
instance that gives up waiting fails the request (--kv-load-failure-policy fail), one whose
prefill instance is killed mid-transfer recomputes it (recompute), each within
--kv-transfer-timeout, and neither side keeps a block. The prefill instance waits before each push
(a test-only delay) so that the transfer is surely under way when the test strikes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from disagg_utils import decode, disaggregated, kv_info, prefill, wait_idle
from server_utils import core_pid

KV = ("--kv-transfer", "nixl", "--block-size", "4", "--kv-cache-memory", "32MiB")
PUSH_DELAY_MS = 2500
PROMPT = "A prompt long enough to span several KV blocks of four tokens, so that some blocks move."
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def instances(start_server):
    slow_prefill = start_server("--role", "prefill", *KV, "--debug-kv-push-delay-ms", str(PUSH_DELAY_MS), wait=False)
    recompute = start_server("--role", "decode", *KV, "--kv-transfer-timeout", "20", wait=False)
    fail = start_server("--role", "decode", *KV, "--kv-transfer-timeout", "1", "--kv-load-failure-policy", "fail")
    for server in (slow_prefill, recompute):
        server.wait_healthy()
    yield slow_prefill, recompute, fail
    for server in (slow_prefill, recompute, fail):
        server.stop()


def test_a_load_that_outlasts_the_timeout_fails_the_request(instances):
    slow_prefill, _, fail = instances
    assert prefill(slow_prefill.url, "/v1/completions", BODY, "too-slow").status_code == 200
    started = time.monotonic()
    response = decode(fail.url, "/v1/completions", BODY, "too-slow", kv_info(slow_prefill.url))
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"] == ""
    assert elapsed < 1 + 3, f"the decode side waited {elapsed:.1f} s past its 1 s timeout"
    assert fail.metrics()["moeserve:kv_transfer_failures_total{cause=timeout,role=decode}"] == 1
    # The prefill side's push comes after the decode side gave up: it writes nothing, frees its blocks.
    time.sleep(PUSH_DELAY_MS / 1000)
    wait_idle(slow_prefill, fail)
    assert slow_prefill.metrics()["moeserve:kv_transfer_failures_total{cause=timeout,role=prefill}"] >= 1


def test_a_prefill_killed_mid_transfer_is_recomputed_on_the_decode_side(instances):
    slow_prefill, recompute, _ = instances
    expected = disaggregated(slow_prefill.url, recompute.url, BODY)["choices"][0]["text"]
    assert recompute.metrics()["moeserve:kv_transfer_bytes_total{role=decode}"] > 0

    info = kv_info(slow_prefill.url)
    assert prefill(slow_prefill.url, "/v1/completions", BODY, "doomed").status_code == 200
    answer: dict = {}

    def ask() -> None:
        started = time.monotonic()
        answer["response"] = decode(recompute.url, "/v1/completions", BODY, "doomed", info)
        answer["elapsed"] = time.monotonic() - started

    asker = threading.Thread(target=ask)
    asker.start()
    deadline = time.monotonic() + 10
    while recompute.metrics()["moeserve:kv_transfers_in_flight{role=decode}"] < 1:
        assert time.monotonic() < deadline, "the transfer never started"
        time.sleep(0.05)
    os.kill(core_pid(slow_prefill.log()), signal.SIGKILL)  # the side channel and the KV die with the core
    slow_prefill.proc.kill()
    asker.join(30)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    assert answer["elapsed"] < 20
    assert recompute.metrics()["moeserve:kv_transfer_failures_total{cause=unreachable,role=decode}"] == 1
    wait_idle(recompute)
