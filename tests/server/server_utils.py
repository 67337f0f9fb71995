"""The real server in a child process (`python -m moeserve launch`), on a free loopback port.

Each server runs the command users run, so signals, logging and exit codes are tested as
shipped. The port is chosen by the server (`--port 0`) and read from its log, so parallel test
runs never race for one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

LISTENING = re.compile(r"listening on (http://\S+?):(\d+)")
MAX_MODEL_LEN = 192


class ServerProcess:
    """A running `moeserve launch`; `url` is its base URL once it is healthy."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve", "launch", "--port", "0", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.url = self._wait_listening()

    def log(self) -> str:
        return self.log_path.read_text()

    def _wait_listening(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = LISTENING.search(self.log())
            if match:
                return f"{match.group(1)}:{match.group(2)}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"server did not listen within {timeout} s:\n{self.log()}")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy within {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        return metric_samples(self.url)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def core_pid(log: str) -> int:
    """The engine core process's pid, from the server's log."""
    match = re.search(r"engine core process started \(pid (\d+)\)", log)
    assert match, log
    return int(match.group(1))


def metric_samples(url: str) -> dict[str, float]:
    """Every sample of `url`/metrics by name and labels, e.g. `moeserve:kv_cache_blocks_used`
    or `moeserve:request_success_total{finished_reason=abort}` (model_name dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _parents() -> dict[int, int]:
    """Every process's parent, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    found[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # gone meanwhile
                continue
    return found


def descendants(pid: int, *, but: int) -> set[int]:
    """The processes `pid` started and those they started, leaving out `but` and its own."""
    parents, found, todo = _parents(), set(), [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child != but and child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pids: set[int]) -> list[int]:
    """Those of `pids` still running: an exited worker whose forkserver left before reaping it is
    a zombie until init reaps it, which some containers' init never does."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:  # gone
            pass
    return alive
