"""SLO admission where the batch or the cache, not prefill, is what a request waits for.

The issue's run, in steps: a step floor, 40 concurrent streamed completions of 20 tokens, each
asking for a first token within five steps. Once the running batch is full of 20-step streams
(max_num_seqs), or the KV cache holds all the streams it can at full length, a newcomer waits
about twenty steps whatever its prompt: most must get a quick 429 saying so, and >= 90% of those
admitted must get their first token in time, by the engine's tally on /metrics (each promise is
judged by the engine's clock, as TTFT attainment is). Also at --ep 2, where routing must find the
group with a free seat.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

BURST = 40
STEP_MS = 100
TIGHT = {"ttft_ms": 500, "tbt_ms": 2000}
"""Five steps: a request admitted at once has its first token in one or two, with room for a
shared 2-core machine's stalls (there, steps padded to 30 ms took 65 on average under the burst,
and a 150 ms target measured the neighbours); one that waits for a seat needs twenty."""


def streamed(url: str, index: int) -> tuple[int, float, dict | None, str | None]:
    """(status, seconds to the first streamed byte or to the refusal, error body, Retry-After)."""
    body = {"model": "tiny", "prompt": [11 + index] * 8, "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:  # made first: the clock measures the server, not a client's set-up
        started = time.monotonic()
        with client.stream("POST", f"{url}/v1/completions", json={**body, "slo": TIGHT}) as response:
            if response.status_code != 200:
                response.read()
                seconds = time.monotonic() - started
                return response.status_code, seconds, response.json(), response.headers["Retry-After"]
            first = None
            for _ in response.iter_bytes():
                first = first or time.monotonic() - started
            return 200, first, None, None


@pytest.mark.parametrize(
    "limit, args",
    [
        ("a seat", ("--max-num-seqs", "4")),
        # 8-token prompts and 20 tokens: 2 blocks of 16 each at full length, so 6 streams fill 12.
        ("KV blocks", ("--max-num-seqs", "32", "--kv-cache-blocks", "12")),
        ("a seat", ("--max-num-seqs", "4", "--ep", "2")),
    ],
    ids=["seats", "kv_blocks", "ep2"],
)
def test_a_burst_past_capacity_is_mostly_refused_and_the_admitted_get_their_first_token_in_time(
    start_server, limit: str, args: tuple[str, ...]
) -> None:
    server = start_server(
        "--scheduling-policy", "slo", "--slo-admission", "reject", "--debug-min-step-time-ms", str(STEP_MS), *args
    )
    before = server.metrics()
    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(lambda i: streamed(server.url, i), range(BURST)))

    refused = [r for r in results if r[0] == 429]
    admitted = [r for r in results if r[0] == 200]
    assert len(refused) + len(admitted) == BURST, results
    assert len(refused) >= BURST // 2, results  # most of the burst cannot have its first token in time
    for _, seconds, body, retry_after in refused:
        assert seconds < 2.0, results  # at once (the HTTP burst itself takes ~1 s here), not after ~20 steps
        error = body["error"]
        assert error["code"] == "slo_unattainable", body
        assert int(retry_after) >= 1
    # Each says why; one that came late to the engine (a busy machine) may miss by what it waited.
    naming = [r for r in refused if f"waiting mostly for {limit}" in r[2]["error"]["message"]]
    assert len(naming) >= 0.75 * len(refused), refused
    metrics = server.metrics()
    promised, kept = (
        metrics[name] - before[name]
        for name in ("moeserve:slo_admission_promised_requests_total", "moeserve:slo_admission_promises_kept_total")
    )
    assert promised == len(admitted), (metrics, results)
    assert kept >= 0.9 * promised, (kept, promised, results)
    assert metrics["moeserve:slo_rejections_total{class=custom}"] == len(refused)
