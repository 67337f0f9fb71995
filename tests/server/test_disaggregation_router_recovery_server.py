"""The router keeps its instances' health current: a decode instance that dies is taken out of the
choice (clients get a clear 503, the router's /health says so), and one that comes back on the
same address is routed to again without restarting the router."""

from __future__ import annotations

import time

import httpx
from disagg_utils import RouterProcess
from server_utils import metric_samples

from moeserve.kv_transfer.side_channel import free_port

DISAGG = ("--kv-transfer", "nixl", "--block-size", "4", "--kv-cache-memory", "32MiB")
BODY = {"model": "tiny", "prompt": "A fox came back to the river bank.", "max_tokens": 6, "temperature": 0}


def _wait_for(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
        time.sleep(0.25)


def test_a_decode_instance_that_dies_and_comes_back_is_routed_to_again(start_server, tmp_path):
    port = free_port("127.0.0.1")
    prefill = start_server("--role", "prefill", *DISAGG, wait=False)
    decoder = start_server("--role", "decode", *DISAGG, "--port", str(port), wait=False)
    prefill.wait_healthy()
    decoder.wait_healthy()
    router = RouterProcess([prefill.url], [decoder.url], tmp_path / "router.log")
    try:
        url = router.wait_listening()
        expected = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
        assert expected.status_code == 200, expected.text

        decoder.stop()
        _wait_for("down", lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503)
        gone = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert gone.status_code == 503 and "no decode instance" in gone.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 503

        back = start_server("--role", "decode", *DISAGG, "--port", str(port))
        _wait_for("back", lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        again = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
        assert metric_samples(url)[f"moeserve_router:instance_healthy{{instance={back.url},role=decode}}"] == 1
        assert "is back" in (tmp_path / "router.log").read_text()
        back.stop()
    finally:
        router.stop()
        prefill.stop()
