"""Smoke check of an installed moeserve: the CLI answers, and the demo model serves one completion.

    VENV/bin/python deploy/docker/smoke.py

Runs `moeserve` from the venv of the python running it, from a scratch folder (so the package
comes from the venv, not from a source tree on the path), with the demo's cache in that folder.
Standard library only: it checks an install, so it must not need anything the install lacks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LISTENING = re.compile(r"listening on (http://\S+?):(\d+)")
STARTUP_S = 180.0


def moeserve(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("moeserve")), *args]


def wait_listening(log: Path, server: subprocess.Popen) -> str:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if match := LISTENING.search(log.read_text()):
            return f"{match.group(1)}:{match.group(2)}"
        if server.poll() is not None:
            raise SystemExit(f"smoke: the server exited with {server.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    raise SystemExit(f"smoke: the server did not listen within {STARTUP_S:.0f} s:\n{log.read_text()}")


def wait_healthy(url: str, log: Path, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"smoke: the server exited with {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.2)
    raise SystemExit(f"smoke: the server was not healthy within {STARTUP_S:.0f} s:\n{log.read_text()}")


def complete(url: str) -> str:
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
    choice = answer["choices"][0]
    if answer["usage"]["completion_tokens"] < 1 or choice["finish_reason"] not in ("length", "stop"):
        raise SystemExit(f"smoke: an unexpected completion: {answer}")
    return choice["text"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="moeserve-smoke-") as scratch:
        env = {**os.environ, "MOESERVE_CACHE_DIR": scratch}
        env.pop("PYTHONPATH", None)
        for args in (("--help",), ("launch", "--help")):
            subprocess.run(moeserve(*args), cwd=scratch, env=env, check=True, stdout=subprocess.DEVNULL)
        log = Path(scratch) / "server.log"
        with open(log, "w") as out:
            server = subprocess.Popen(
                moeserve("launch", "--device", "cpu", "--host", "127.0.0.1", "--port", "0"),
                cwd=scratch,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            url = wait_listening(log, server)
            wait_healthy(url, log, server)
            print(f"smoke: the demo answered {complete(url)!r}")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
