"""A decode instance killed mid-stream behind the router: the client's stream ends with an error
event (never a silent end), the router stops sending requests there, and the prefill instance,
which survives, keeps no block."""

from __future__ import annotations

import os
import signal
import time

import httpx
from disagg_utils import RouterProcess
from server_utils import core_pid

KV = ("--kv-transfer", "nixl", "--block-size", "4", "--kv-cache-memory", "32MiB")
BODY = {"model": "tiny", "prompt": "A prompt that spans a few KV blocks of four tokens.", "temperature": 0}


def test_a_decode_killed_mid_stream_ends_the_stream_with_an_error(start_server, tmp_path):
    prefill = start_server("--role", "prefill", *KV, wait=False)
    decoder = start_server("--role", "decode", *KV, "--debug-min-step-time-ms", "50")  # a stream of seconds
    prefill.wait_healthy()
    router = RouterProcess([prefill.url], [decoder.url], tmp_path / "router.log")
    try:
        router.wait_listening()
        lines = []
        body = {**BODY, "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    os.kill(core_pid(decoder.log()), signal.SIGKILL)
                    decoder.proc.kill()
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "the decode instance failed mid-stream" in events[-2]
        again = httpx.post(f"{router.url}/v1/completions", json={**BODY, "max_tokens": 4}, timeout=120)
        assert again.status_code == 503 and "no decode instance" in again.json()["error"]["message"]
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert f'moeserve_router:instance_failures_total{{instance="{decoder.url}",role="decode"}} 1.0' in metrics
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
    finally:
        router.stop()
    deadline = time.monotonic() + 10
    while (held := prefill.metrics())["moeserve:kv_cache_blocks_used"] or held[
        "moeserve:kv_transfer_held_blocks{role=prefill}"
    ]:
        assert time.monotonic() < deadline, "the prefill instance kept blocks"
        time.sleep(0.2)
