"""The engine core runs in its own process: if it dies, the server must not keep answering 200 on
/health while it hangs requests. It fails the open stream in-band, says why in its log, and exits 1."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from server_utils import core_pid, descendants, running


def health_statuses(url: str, until: float) -> list[int | None]:
    """/health every 20 ms until `until` or until the server stops answering (None)."""
    seen: list[int | None] = []
    while time.monotonic() < until:
        try:
            seen.append(httpx.get(f"{url}/health", timeout=1).status_code)
        except httpx.TransportError:
            seen.append(None)
            return seen
        time.sleep(0.02)
    return seen


def test_a_dead_engine_core_fails_requests_turns_unhealthy_and_exits_1(start_server) -> None:
    # Steps are slowed so the stream below is surely mid-flight when the core goes.
    server = start_server("--debug-min-step-time-ms", "30")
    pid = core_pid(server.log())
    lines: list[str] = []
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    statuses = health_statuses(server.url, until=killed_at + 10)
    assert statuses[-1] in (503, None), statuses  # no longer healthy, and never healthy again
    assert server.proc.wait(timeout=30) == 1
    assert time.monotonic() - killed_at < 30
    log = server.log()
    assert f"the engine core process (pid {pid}) was killed by SIGKILL" in log, log
    assert "shutting the server down" in log
    reader.join(10)
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "SIGKILL" in lines[-2], lines[-3:]


def test_a_killed_server_leaves_no_process_behind(start_server) -> None:
    """SIGKILL gives the server no chance to stop anything: its engine core, the forkserver the
    core and the grammar workers were forked from, and those workers must notice and leave by
    themselves. The core's parent is the forkserver, which outlives the server while the core
    holds its pipe open, so the core must watch the server, not its own parent."""
    server = start_server()
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    core = core_pid(server.log())
    # The core, the forkserver, the resource tracker and two grammar workers (forked by the pool's
    # threads after the core: on a loaded machine they may still be on their way).
    deadline = time.monotonic() + 30
    while len(helpers := descendants(server.proc.pid, but=-1)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core in helpers and len(helpers) == 5, helpers
    server.proc.kill()
    server.proc.wait(10)
    killed_at = time.monotonic()
    while running(helpers) and time.monotonic() - killed_at < 10:
        time.sleep(0.05)
    assert not running(helpers), [open(f"/proc/{pid}/cmdline").read()[:80] for pid in running(helpers)]
    print(f"\n[server killed] its {len(helpers)} helper processes gone {time.monotonic() - killed_at:.2f} s later")
