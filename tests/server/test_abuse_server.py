"""Costly input from one client must not deny service to others: attacks on structured outputs
(big enums, deep nesting, pathological regexes, 1,000 tools) against the real server while an
ordinary client keeps asking for small structured outputs.

Each attack asserts: the attacker is refused (400 naming the field, or 429 for a client over
its compile queue) within the compile timeout plus a margin, or leaves on its own; the ordinary
client's worst latency stays under 2 s; the engine core spends next to no CPU (read from
/proc/<pid>/stat); and afterwards no compile runs and no process was left behind. A summary
line per attack is printed (`pytest -s` shows them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest
from server_utils import ServerProcess, core_pid, descendants, running

COMPILE_TIMEOUT_S = 3.0
MARGIN_S = 2.0
ABANDON_S = 5.0  # the attackers' client timeout, as in the issue's report
ORDINARY_WORST_S = 2.0
COMPILE_WORKERS = 2  # the default
CORE_CPU_S = 1.5  # the engine core's CPU seconds an attack may cost (ordinary traffic included)
ORDINARY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "a"}],
    "max_tokens": 8,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    },
}


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}


def _schema(schema: dict) -> dict:
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _slow_regex(tag: int) -> dict:
    """A regex of 6 KB, under every static limit, that compiles for seconds into tens of MB
    (1,000 optional letters; 20 s on a loaded 2-core machine): refused at the timeout, or for its
    compiled size."""
    return _chat(structured_outputs={"regex": f"{tag}" + "[a-z]?" * 1000})


def _tools(count: int) -> dict:
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}
        for i in range(count)
    ]
    return _chat(tools=tools, tool_choice="required")


ATTACKS = {
    # name: (bodies sent at once, the field a 400 must name)
    "enum-200k-x4": ([_schema({"enum": [f"value-{i:06d}" for i in range(200_000)]})] * 4, "response_format"),
    "nesting-40-x4": ([_schema(_nested(40 + i)) for i in range(4)], "response_format"),
    "slow-regex-x6": ([_slow_regex(i) for i in range(6)], "structured_outputs"),
    "tools-1000-x4": ([_tools(1000)] * 4, "tools"),
}


@dataclass
class Outcome:
    attackers: list[str] = field(default_factory=list)
    ordinary_worst_s: float = 0.0
    core_cpu_s: float = 0.0
    wall_s: float = 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def helpers(server: ServerProcess, core: int) -> set[int]:
    """The API process's helper processes: the compile workers, the forkserver they are forked
    from, and multiprocessing's resource tracker (the engine core and its own are left out)."""
    return descendants(server.proc.pid, but=core)


@pytest.fixture(scope="module")
def abuse_server(start_server):
    server = start_server("--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S))
    response = httpx.post(f"{server.url}/v1/chat/completions", json=ORDINARY, timeout=120)  # waits for a worker
    assert response.status_code == 200, response.text
    yield server
    server.stop()


async def _attack(url: str, bodies: list[dict], param: str) -> list[str]:
    async def one(client: httpx.AsyncClient, body: dict) -> str:
        started = time.monotonic()
        try:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
        except httpx.TimeoutException:
            return f"abandoned@{time.monotonic() - started:.1f}s"
        elapsed = time.monotonic() - started
        assert response.status_code in (400, 429), response.text[:300]
        error = response.json()["error"]
        assert error["param"] == param and "--" in error["message"], error
        assert elapsed <= COMPILE_TIMEOUT_S + MARGIN_S, (elapsed, error)
        return f"{response.status_code}@{elapsed:.1f}s"

    headers = {"Authorization": "Bearer attacker"}
    async with httpx.AsyncClient(timeout=ABANDON_S, headers=headers) as client:
        return await asyncio.gather(*(one(client, body) for body in bodies))


async def _ordinary(url: str, done: asyncio.Event) -> float:
    worst = 0.0
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer ordinary"}) as client:
        while not done.is_set():
            started = time.monotonic()
            response = await client.post(f"{url}/v1/chat/completions", json=ORDINARY)
            worst = max(worst, time.monotonic() - started)
            assert response.status_code == 200, response.text
            await asyncio.sleep(0.1)
    return worst


async def _run(server: ServerProcess, name: str) -> Outcome:
    bodies, param = ATTACKS[name]
    core = core_pid(server.log())
    cpu_before, started = cpu_seconds(core), time.monotonic()
    done = asyncio.Event()
    ordinary = asyncio.ensure_future(_ordinary(server.url, done))
    await asyncio.sleep(0.3)
    attackers = await _attack(server.url, bodies, param)
    await asyncio.sleep(0.5)  # ordinary traffic just after the attack counts too
    done.set()
    worst = await ordinary
    return Outcome(attackers, worst, cpu_seconds(core) - cpu_before, time.monotonic() - started)


def _busy_cpu(pids: set[int], seconds: float) -> float:
    """CPU seconds `pids` (those still alive) spend over `seconds`: a compile left running for
    an attacker who was refused or left would be one of them."""

    def total() -> float:
        found = 0.0
        for pid in pids:
            try:
                found += cpu_seconds(pid)
            except OSError:  # killed, as a cancelled compile's worker is
                pass
        return found

    before = total()
    time.sleep(seconds)
    return total() - before


def _settled_workers(server: ServerProcess, core: int) -> set[int]:
    """The API process's helpers (`helpers`) once all are started and idle: a worker killed by an
    earlier attack is replaced by one that loads the tokenizer for a fraction of a CPU second."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = helpers(server, core)
        if len(workers) == COMPILE_WORKERS + 2 and _busy_cpu(workers, 0.5) < 0.05:
            return workers
    raise AssertionError(f"the compile workers did not settle: {helpers(server, core)}")


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_is_refused_and_others_are_served(abuse_server: ServerProcess, name: str) -> None:
    core = core_pid(abuse_server.log())
    workers = _settled_workers(abuse_server, core)
    outcome = asyncio.run(_run(abuse_server, name))
    print(
        f"\n[abuse] {name}: attackers {' '.join(outcome.attackers)}; ordinary worst {outcome.ordinary_worst_s:.2f} s; "
        f"engine core {outcome.core_cpu_s:.2f} CPU s over {outcome.wall_s:.1f} s"
    )
    assert outcome.ordinary_worst_s < ORDINARY_WORST_S
    assert outcome.core_cpu_s < CORE_CPU_S
    assert any(a.startswith("400") for a in outcome.attackers)
    # Nothing left compiling for an attacker who was refused or left (the workers that ran its
    # compiles were killed; their replacements start), and as many processes as before.
    assert _busy_cpu(workers, 1.0) < 0.2
    assert len(helpers(abuse_server, core)) == len(workers)


def test_a_timed_out_spec_is_compiled_again_and_counted(abuse_server: ServerProcess) -> None:
    """A timeout says how loaded the workers were, not that the spec is bad: the next request
    compiles it again (it is not refused from the cache), and each timeout is counted. Invalid
    specs are cached (tests/unit/test_compile_pool.py)."""
    body, times, messages = _slow_regex(50), [], []
    counted = abuse_server.metrics()["moeserve:structured_outputs_compile_timeouts_total"]
    for _ in range(2):
        started = time.monotonic()
        response = httpx.post(f"{abuse_server.url}/v1/chat/completions", json=body, timeout=60)
        times.append(time.monotonic() - started)
        assert response.status_code == 400, response.text
        messages.append(response.json()["error"]["message"])
    assert all("--structured-outputs-compile-timeout" in message for message in messages), messages
    assert min(times) >= COMPILE_TIMEOUT_S, times
    assert abuse_server.metrics()["moeserve:structured_outputs_compile_timeouts_total"] == counted + 2


def test_shutdown_does_not_wait_on_a_compile(abuse_server: ServerProcess) -> None:
    core = core_pid(abuse_server.log())
    pids = _settled_workers(abuse_server, core) | descendants(abuse_server.proc.pid, but=-1)
    body = _slow_regex(99)

    async def slow() -> int:
        async with httpx.AsyncClient(timeout=30) as client:
            return (await client.post(f"{abuse_server.url}/v1/chat/completions", json=body)).status_code

    async def stop_during_compile() -> float:
        request = asyncio.ensure_future(slow())
        await asyncio.sleep(0.5)
        started = time.monotonic()
        abuse_server.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(request, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, abuse_server.proc.wait, 30)
        return time.monotonic() - started

    stopped_in = asyncio.run(stop_during_compile())
    print(f"\n[abuse] shutdown during a compile: {stopped_in:.1f} s, exit code {abuse_server.proc.returncode}")
    assert abuse_server.proc.returncode == 0
    assert stopped_in < COMPILE_TIMEOUT_S + 5  # before: the core compiled on and had to be killed after 10 s
    deadline = time.monotonic() + 2.0  # the resource tracker leaves when it sees its parent gone
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pids)
