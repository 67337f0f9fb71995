"""`retain_freed_host_memory`: memory a step frees comes back without page faults next step."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from unittest import mock

import pytest

from moeserve.worker import runner

# Each "step" mallocs three 10 MiB buffers, writes them and frees them, as a CPU step does with its
# activations; the faults of each step are counted in a fresh process (malloc's state is global).
STEPS = """
import ctypes, json, resource, sys
from moeserve.worker.host_memory import retain_freed_host_memory
if sys.argv[1] == "retain":
    assert retain_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 10 << 20
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(size) for _ in range(3)]
    for buffer in buffers:
        libc.memset(buffer, 1, size)
    for buffer in buffers:
        libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES_PER_STEP = 3 * (10 << 20) // 4096


def faults_per_step(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_glibc_defaults_fault_in_every_step_and_retained_memory_does_not() -> None:
    default, retained = faults_per_step("default"), faults_per_step("retain")
    # glibc's own thresholds hand the 30 MiB back after each step: every step faults it in again
    assert min(default[2:]) > PAGES_PER_STEP // 2, default
    # retained, only the first step touches fresh pages
    assert retained[0] > PAGES_PER_STEP // 2, retained
    assert max(retained[1:]) < PAGES_PER_STEP // 100, retained


def test_a_cpu_runner_retains_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner sets it up for its process when it computes on CPU, and only then."""
    calls = []
    monkeypatch.setattr(runner, "retain_freed_host_memory", lambda: calls.append(True))
    model = mock.Mock()
    model.cfg.vocab_size = 32
    runner.ModelRunner(model, [], 16, [0], "cpu", seed=0)
    assert calls == [True]
    runner.ModelRunner(model, [], 16, [0], "meta", seed=0)
    assert calls == [True]
