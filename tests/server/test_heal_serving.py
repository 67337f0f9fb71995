"""`--on-rank-failure heal`: lose ranks mid-stream and keep serving (CPU, gloo, ep=4).

One server lives through three losses: a rank killed (SIGKILL) while 12 greedy streams run, then
a rank frozen (SIGSTOP, seen by its silent heartbeat) while 12 more run, then one more loss,
which leaves fewer ranks than `--min-ranks` and stops the server as a lost rank always did.
Every stream must complete with exactly its no-failure text (so nothing a client was sent is sent
again or changed), /health must stay 200, the KV blocks must all come back, and the lost rank
processes must be gone, not zombies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
from server_utils import MAX_MODEL_LEN, ServerProcess
from test_ep_serving import SMALL_KV, is_alive, rank_pids

from moeserve import LLM, SamplingParams

PROMPTS = [f"stream {i}: {'mixture of experts ' * (i % 4)}hello" for i in range(12)]
MAX_TOKENS = 32


def stream(server: ServerProcess, prompt: str, out: dict) -> None:
    """One greedy streamed completion; `out` gets its text, finish reason and any error event."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    text, finish, errors = [], None, []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=90) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            choice = chunk["choices"][0]
            text.append(choice["text"])
            finish = choice.get("finish_reason") or finish
    out.update(text="".join(text), finish=finish, errors=errors)


def streams_through_a_loss(server: ServerProcess, pid: int, sig: signal.Signals) -> tuple[list[dict], list[int]]:
    """Start every prompt's stream, hit rank process `pid` with `sig` once they are all under
    way, and watch /health until they end; returns their outcomes and the /health codes seen."""
    outcomes: list[dict] = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(server, p, o), daemon=True) for p, o in zip(PROMPTS, outcomes)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(pid, sig)
    health = []
    while any(t.is_alive() for t in threads):
        health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)
        time.sleep(0.1)
    return outcomes, health


def test_lost_ranks_heal_and_every_stream_continues(start_server, server_checkpoint: Path) -> None:
    reference = LLM(str(server_checkpoint), max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    reference.engine.shutdown()
    server = start_server(
        "--ep", "4", "--on-rank-failure", "heal", "--min-ranks", "2", "--heartbeat-timeout", "2",
        "--debug-min-step-time-ms", "40", *SMALL_KV,
    )  # fmt: skip
    pids = rank_pids(server)

    for heals, (victim, sig) in enumerate([(2, signal.SIGKILL), (0, signal.SIGSTOP)], start=1):
        outcomes, health = streams_through_a_loss(server, pids[victim], sig)
        assert [o["text"] for o in outcomes] == expected
        assert all(o["status"] == 200 and o["finish"] == "length" and not o["errors"] for o in outcomes)
        assert set(health) == {200}
        metrics = server.metrics()
        assert metrics["moeserve:heals_total"] == heals
        assert metrics["moeserve:rank_failures_total"] == heals
        assert 0 < metrics["moeserve:last_heal_seconds"] < 10.0
        assert metrics["moeserve:kv_cache_blocks_used"] == 0
        assert not is_alive(pids[victim])  # fenced and reaped: no zombie, the frozen one included
        match = re.findall(rf"healed: lost rank\(s\) {victim} \(.*\); serving on {4 - heals} ranks", server.log())
        assert match, server.log()[-3000:]

    # Two ranks left; losing one more would leave fewer than --min-ranks: the server stops, as it
    # does without healing, and names why.
    os.kill(pids[1], signal.SIGKILL)
    assert server.proc.wait(timeout=30) == 1
    assert re.search(r"lost a rank: rank 1 .*was killed by SIGKILL.*fewer than --min-ranks 2", server.log())
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p) for p in pids)
