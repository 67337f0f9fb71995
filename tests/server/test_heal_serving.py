"""`--on-rank-failure heal`: lose ranks mid-stream and keep serving (CPU, gloo, ep=4).

One server lives through three losses: a rank killed (SIGKILL) while 12 greedy streams run, then
a rank frozen (SIGSTOP, seen by its silent heartbeat) while 12 more run, then one more loss,
which leaves fewer ranks than `--min-ranks` and stops the server as a lost rank always did.
Another, with redundant experts and the default policy, heals over a frozen rank and then takes
the rank back: node 0 restarts it, and it rejoins while streams run.
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
import pytest
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


@pytest.fixture(scope="module")
def expected(server_checkpoint: Path) -> list[str]:
    """Every prompt's greedy text from one process, no rank lost."""
    reference = LLM(str(server_checkpoint), max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    texts = [o.outputs[0].text for o in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    reference.engine.shutdown()
    return texts


def test_lost_ranks_heal_and_every_stream_continues(start_server, expected: list[str]) -> None:
    server = start_server(
        "--ep", "4", "--on-rank-failure", "heal", "--min-ranks", "2", "--rank-restarts", "0",
        "--heartbeat-timeout", "2", "--debug-min-step-time-ms", "40", *SMALL_KV,
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


def streams(server: ServerProcess, prompts: list[str]) -> list[dict]:
    """Every prompt's stream at once, to their ends."""
    outcomes: list[dict] = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(server, p, o), daemon=True) for p, o in zip(prompts, outcomes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return outcomes


def test_a_frozen_rank_heals_over_replicas_then_comes_back_and_serves(start_server, expected: list[str]) -> None:
    """The default policy heals; the frozen rank's slots come from replicas (rank 0 held experts
    0-4, rank 3 holds replicas of 0-3) and the checkpoint; node 0 restarts it and it rejoins
    between two steps of running streams, unchanged by it."""
    server = start_server(
        "--ep", "4", "--num-redundant-experts", "4", "--rank-restarts", "1", "--heartbeat-timeout", "2",
        "--debug-min-step-time-ms", "40", *SMALL_KV,
    )  # fmt: skip
    pids = rank_pids(server)
    outcomes, health = streams_through_a_loss(server, pids[0], signal.SIGSTOP)
    assert [o["text"] for o in outcomes] == expected
    assert set(health) == {200}
    assert server.metrics()["moeserve:heals_total"] == 1
    healed = r"healed: lost rank\(s\) 0 .*; serving on 3 ranks .* [1-9]\d* slots from surviving replicas"
    assert re.search(healed, server.log()), server.log()[-3000:]

    # Half the streams run until the restarted rank has rejoined, and once more with it serving.
    few = len(PROMPTS) // 2
    rounds_after = 0
    deadline = time.monotonic() + 90
    while rounds_after < 1 and time.monotonic() < deadline:
        rounds_after += server.metrics()["moeserve:rank_rejoins_total"] == 1
        outcomes = streams(server, PROMPTS[:few])
        assert [o["text"] for o in outcomes] == expected[:few]
        assert all(o["status"] == 200 and not o["errors"] for o in outcomes)
    metrics = server.metrics()
    assert metrics["moeserve:rank_rejoins_total"] == 1, server.log()[-3000:]
    assert 0 < metrics["moeserve:last_rejoin_seconds"] < 10.0
    assert metrics["moeserve:kv_cache_blocks_used"] == 0
    log = server.log()
    assert re.search(r"rejoined: rank\(s\) 0 back, serving on 4 ranks", log), log[-3000:]
    assert re.search(r"rank 0 is group rank 3 of 4 \(generation 2\)", log), log[-3000:]
    assert not is_alive(pids[0])  # the frozen process was fenced; a new one serves as rank 0
    assert server.stop() == 0
