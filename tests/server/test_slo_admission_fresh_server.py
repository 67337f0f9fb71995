"""SLO admission keeps its promises from a server's first request: nothing warms it up.

The issue's run: a fresh server (steps padded to 30 ms, four seats), then 40 concurrent streamed
completions of 20 tokens, each asking for its first token within 150 ms. Four can start at once;
every later one waits twenty steps for a seat, far over its target. Before the server profiled its
steps at start-up, admission predicted nothing until it had watched 16 steps: it admitted what it
could not serve (8 admitted, none on time) and refused the rest only once it could predict (17 of
32 refusals after a second or more). Now every admitted request is promised its first token, >= 90%
of those promises are kept (judged by the engine's own clock, as TTFT attainment is), and every
refusal arrives within about a second (`REFUSAL_S`, with a loaded CI machine's margin). (At
--ep 2 on a 2-core machine the burst's first steps run several times slower than the profiled
ones, two rank processes and the API sharing the cores, and the promises are not kept: that case
is left to the capacity test, which admits within its seats.)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

BURST = 40
TTFT = {"ttft_ms": 150}
REFUSAL_S = 1.5


def burst(url: str) -> list[tuple[int, float]]:
    """Send the burst's requests at once, each from its own thread and client (made beforehand,
    so that the clock measures the server, not a client's set-up): (status, seconds from the
    request's sending to the refusal or to the end of the stream) for each. The clock starts as
    httpx sends (its request hook), not as the thread is released: forty threads of one process
    take their turns at the interpreter to build their requests, which on a loaded machine alone
    took a few hundred milliseconds of a refusal's second."""
    ready = threading.Barrier(BURST)

    def send(index: int) -> tuple[int, float]:
        body = {"model": "tiny", "prompt": [11 + index] * 8, "max_tokens": 20, "ignore_eos": True, "stream": True}
        sent: list[float] = []
        hooks = {"request": [lambda request: sent.append(time.monotonic())]}
        with httpx.Client(base_url=url, timeout=60, event_hooks=hooks) as client:
            ready.wait()
            with client.stream("POST", "/v1/completions", json={**body, "slo": TTFT}) as response:
                response.read()
                return response.status_code, time.monotonic() - sent[0]

    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(send, range(BURST)))


def test_a_fresh_server_promises_only_what_it_keeps_and_refuses_at_once(start_server) -> None:
    server = start_server(
        "--scheduling-policy",
        "slo",
        "--slo-admission",
        "reject",
        "--max-num-seqs",
        "4",
        "--debug-min-step-time-ms",
        "30",
    )
    assert "step-time profile: " in server.log()  # fitted before the server said it was healthy
    results = burst(server.url)

    refused = [seconds for status, seconds in results if status == 429]
    admitted = [seconds for status, seconds in results if status == 200]
    assert len(refused) + len(admitted) == BURST, results
    assert admitted and len(refused) >= BURST // 2, results
    # Refused at once, not once the models had watched steps: within about a second. CI's two test
    # workers on two cores made it 1.14 s from the request's sending (a quiet machine: well under);
    # 1.5 s keeps the margin. The promises below are what the old behaviour failed outright.
    assert max(refused) < REFUSAL_S, results
    metrics = server.metrics()
    promised = metrics["moeserve:slo_admission_promised_requests_total"]
    kept = metrics["moeserve:slo_admission_promises_kept_total"]
    assert promised == len(admitted), (metrics, results)
    assert kept >= 0.9 * promised, (kept, promised, results)
