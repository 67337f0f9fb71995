"""Multi-process serving: a lost rank stops the server fast and says which; two nodes on loopback.

A rank that dies or freezes must not leave a server that accepts requests and hangs them
(vLLM and SGLang have both shipped that failure mode): /health turns unhealthy within seconds,
the log names the rank, open requests fail, and the process exits non-zero well within 30 s.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import MAX_MODEL_LEN, ServerProcess

from moeserve import LLM, SamplingParams

EXIT_WITHIN_S = 30.0
SMALL_KV = ("--kv-cache-memory", "32MiB")


def rank_pids(server: ServerProcess) -> list[int]:
    match = re.search(r"node 0: started ranks \d+-\d+ \(pids ([\d, ]+)\)", server.log())
    assert match, server.log()
    return [int(p) for p in match.group(1).split(", ")]


def wait_unhealthy(server: ServerProcess, timeout: float) -> float:
    """Seconds until /health stops answering 200 (or the server stops answering at all)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code != 200:
                break
        except httpx.TransportError:
            break
        time.sleep(0.05)
    return time.monotonic() - started


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose once its parent is gone.
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False


def long_stream(server: ServerProcess, outcome: list) -> threading.Thread:
    """A streamed request still running when the rank goes; records how it ended."""

    def run() -> None:
        body = {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 180,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                outcome.append(response.status_code)
                outcome.append([line for line in response.iter_lines() if line])
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_lost_rank_stops_the_server_and_names_it(start_server, how: str) -> None:
    # Steps are slowed so the stream below is surely mid-flight when the rank goes.
    server = start_server(
        "--ep", "2", "--on-rank-failure", "exit", "--heartbeat-timeout", "2", "--debug-min-step-time-ms", "30",
        *SMALL_KV,
    )  # fmt: skip
    pids = rank_pids(server)
    outcome: list = []
    stream = long_stream(server, outcome)
    time.sleep(1.0)
    os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    lost_at = time.monotonic()

    # Bounds leave room for 2 loaded CPU cores (they were 1 s and 5 s). That a killed rank is seen by its
    # exit, not by the 2 s heartbeat timeout, is proven by the log's reason below, not by this clock.
    assert wait_unhealthy(server, timeout=15.0) < (3.0 if how == "killed" else 8.0)
    server.proc.wait(timeout=EXIT_WITHIN_S)
    exited_after = time.monotonic() - lost_at
    assert server.proc.returncode == 1
    assert exited_after < EXIT_WITHIN_S
    log = server.log()
    reason = "was killed by SIGKILL" if how == "killed" else "sent no heartbeat"
    assert re.search(rf"lost a rank: rank 1 \(node 0.*{reason}", log), log
    stream.join(10)
    assert not stream.is_alive()
    # The open stream was mid-flight (200, tokens sent) and ended with an error event, then [DONE]:
    # a client can tell it failed, rather than mistake the cut for a finish.
    assert outcome[0] == 200, outcome
    lines = outcome[1]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert '"error"' in lines[-2] and "rank" in lines[-2], lines[-3:]
    tokens = [line for line in lines[:-2] if '"text"' in line]
    assert tokens and not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    # Nothing is left behind, the frozen rank included.
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p) for p in pids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_serve_like_one_process(start_server, server_checkpoint: Path, tmp_path: Path) -> None:
    """Node 1 (ranks 2-3) starts first and waits for node 0; both run the same flags."""
    port = str(free_port())
    flags = ["--ep", "4", "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "moeserve", "launch", *flags, "--node-rank", "1"],
        stdout=node1_log,
        stderr=subprocess.STDOUT,
    )
    try:
        server = start_server(*flags, *SMALL_KV)
        log = server.log()
        assert "4 ranks on 2 node(s)" in log
        assert re.search(r"rank 3 \(node 1,", log), log
        prompts = ["Hello there", "a", "Mixture of experts models route every token"]
        reference = LLM(str(server_checkpoint), max_model_len=MAX_MODEL_LEN)
        expected = [
            o.outputs[0].text
            for o in reference.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
        ]
        got = []
        for prompt in prompts:
            response = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["text"])
        assert got == expected
        assert server.stop() == 0
        # Node 0 said stop; node 1's ranks and then node 1 itself finish cleanly.
        assert node1.wait(timeout=EXIT_WITHIN_S) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
