"""SLO admission end to end: under load, a request whose TTFT target cannot be met is refused at
once with 429 and Retry-After, one that can wait is served, and /metrics counts the refusal by class.

Steps are padded to 30 ms and the step budget is 32 tokens, so twelve requests (150-token prompts,
32 tokens out) over eight seats queue over a second of prefill and decode: far over a 300 ms target, well
within 20 s. (Eight of them, of 4 tokens, were often all seated before four could be seen waiting:
the load was gone when the tight request came, and it was rightly admitted.)
"""

from __future__ import annotations

import threading
import time

import httpx


def complete(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=timeout)


def test_a_tight_request_is_refused_under_load_and_a_loose_one_admitted(start_server) -> None:
    server = start_server(
        "--slo-admission",
        "reject",
        "--slo-class",
        "chat=ttft:300,tbt:100",
        "--slo-class",
        "batch=ttft:20000,tbt:200",
        "--debug-min-step-time-ms",
        "30",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "32",
    )
    background = [
        threading.Thread(
            target=complete,
            args=(
                server.url,
                {"prompt": [7 + i] * 150, "max_tokens": 32, "ignore_eos": True, "slo": {"class": "batch"}},
            ),
            daemon=True,
        )
        for i in range(12)
    ]
    for thread in background:
        thread.start()
    deadline = time.monotonic() + 20
    while server.metrics().get("moeserve:num_requests_waiting", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)

    tight = complete(server.url, {"prompt": [9] * 20, "max_tokens": 4, "slo": {"class": "chat"}})
    assert tight.status_code == 429, tight.text
    assert int(tight.headers["Retry-After"]) >= 1
    error = tight.json()["error"]
    assert error["code"] == "slo_unattainable" and "exceeds the request's target of 300 ms" in error["message"]

    loose = complete(server.url, {"prompt": [9] * 20, "max_tokens": 4, "slo": {"ttft_ms": 20000, "tbt_ms": 200}})
    assert loose.status_code == 200, loose.text
    for thread in background:
        thread.join(60)

    metrics = server.metrics()
    assert metrics["moeserve:slo_rejections_total{class=chat}"] == 1
    assert metrics["moeserve:slo_rejections_total{class=batch}"] == 0
    assert metrics["moeserve:slo_class_requests_total{class=batch}"] == 13  # the load and the loose one (its class)
    assert metrics["moeserve:slo_class_requests_total{class=chat}"] == 0  # refused requests are not judged
    assert metrics["moeserve:slo_class_ttft_met_requests_total{class=batch}"] == 13
