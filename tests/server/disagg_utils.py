"""Prefill/decode disaggregation in tests: the router in a child process, and the router's two
steps done by hand (for checks that must reach an instance directly)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROUTER_LISTENING = re.compile(r"router listening on (http://[\d.]+:\d+)")


class RouterProcess:
    def __init__(self, prefills: list[str], decodes: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        args = ["--prefill", *prefills, "--decode", *decodes, "--port", "0", "--health-interval", "0.5"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve", "router", *args], stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_listening(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = ROUTER_LISTENING.search(self.log_path.read_text())
            if match:
                self.url = match.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"router did not listen within {timeout} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self._log.close()


def wait_idle(*servers, timeout_s: float = 15.0) -> None:
    """Wait until no KV block is in use or held for a transfer and no transfer is in flight on
    any of `servers`; fail with each one's figures after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {}
        for server in servers:
            m = server.metrics()
            gauges = [v for k, v in m.items() if "kv_transfer_held_blocks" in k or "kv_transfers_in_flight" in k]
            busy[server.url] = (m["moeserve:kv_cache_blocks_used"], sum(gauges))
        if all(b == (0, 0) for b in busy.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"(blocks used, held + in flight) per server: {busy}")
        time.sleep(0.2)


def kv_info(url: str) -> dict:
    return httpx.get(f"{url}/kv/info", timeout=10).json()


def prefill(prefill_url: str, path: str, body: dict, transfer_id: str) -> httpx.Response:
    """The router's first step: the prompt on the prefill instance, its KV held for `transfer_id`."""
    params = {"transfer_id": transfer_id}
    return httpx.post(f"{prefill_url}{path}", json={**body, "max_tokens": 1, "kv_transfer_params": params}, timeout=120)


def decode(decode_url: str, path: str, body: dict, transfer_id: str, prefill_info: dict) -> httpx.Response:
    """The router's second step: generation on the decode instance, from the prefill's KV."""
    params = {"transfer_id": transfer_id, "remote": prefill_info["kv_address"]}
    params.update({key: prefill_info[key] for key in ("model", "block_size", "tp")})
    return httpx.post(f"{decode_url}{path}", json={**body, "kv_transfer_params": params}, timeout=120)


def disaggregated(prefill_url: str, decode_url: str, body: dict) -> dict:
    """A completion computed as the router would, without it."""
    transfer_id = f"test-{uuid.uuid4().hex}"
    assert prefill(prefill_url, "/v1/completions", body, transfer_id).status_code == 200
    response = decode(decode_url, "/v1/completions", body, transfer_id, kv_info(prefill_url))
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, path: str, body: dict) -> str:
    """The text of a streamed completion or chat, chunk by chunk."""
    text = ""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"]
            if choice:
                text += choice[0].get("text") or choice[0].get("delta", {}).get("content") or ""
    return text
