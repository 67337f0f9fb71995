"""Rank processes forked from a warm server: they run the module's `main` as `python -m` would,
with the caller's environment at the call, report their exit codes and signals as
`subprocess.Popen` does, know who started them, and fall back to a fresh interpreter when the
caller's main module would run again in them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from moeserve.distributed import processes
from moeserve.distributed.processes import ForkedChild, start_process


def run_child(tmp_path, monkeypatch, code: int, probe: str):
    monkeypatch.setenv("MOESERVE_CHILD_PROBE", probe)
    out = tmp_path / f"seen-{probe}.json"
    child = start_process("helpers.child_main", [str(out), str(os.getpid()), str(code)])
    return child, out


def test_a_forked_child_runs_main_with_the_callers_environment_and_exit_code(tmp_path, monkeypatch):
    for code, probe in ((0, "first"), (7, "second")):  # the second call sees the changed environment
        child, out = run_child(tmp_path, monkeypatch, code, probe)
        assert isinstance(child, ForkedChild)
        assert child.wait(30) == code and child.poll() == code
        seen = json.loads(out.read_text())
        assert seen["argv"] == [str(out), str(os.getpid()), str(code)]
        assert seen["sys_argv0"] == "helpers.child_main"
        assert seen["env"] == probe
        assert seen["started_by_parent"] and not seen["started_by_other"]
        assert seen["torch_preloaded"]  # forked from the server that imported the worker


def test_a_forked_child_is_signalled_and_reaped_like_popen(tmp_path, monkeypatch):
    child, out = run_child(tmp_path, monkeypatch, -1, "signalled")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:  # main is running, then pauses
        time.sleep(0.05)
    assert child.poll() is None
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.send_signal(signal.SIGKILL)  # a finished child is left alone, as Popen does


def test_a_script_caller_gets_a_fresh_interpreter(tmp_path, monkeypatch):
    """A script's `__main__` would be imported again in a forked child: unguarded code would run
    twice. Such a caller gets `python -m module` instead."""
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "user_script.py")
    script.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    child, out = run_child(tmp_path, monkeypatch, 3, "script")
    assert isinstance(child, subprocess.Popen)
    assert child.wait(60) == 3
    seen = json.loads(out.read_text())
    assert seen["env"] == "script" and seen["started_by_parent"]


@pytest.mark.parametrize(
    "spec_name,file,safe",
    [
        ("moeserve.__main__", "x", True),  # python -m moeserve
        ("pytest.__main__", "x", True),
        ("moeserve.engine.core_process", "x", True),  # ours: guarded
        ("user.tool", "x", False),  # python -m user.tool: run again as __mp_main__
        (None, "script.py", False),
        (None, None, True),  # python -c, a REPL, a notebook
    ],
)
def test_which_callers_may_fork(monkeypatch, spec_name, file, safe):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None
    if file:
        main.__file__ = file
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert processes._main_reimport_is_safe() is safe


def test_the_preloaded_worker_import_leaves_cuda_and_device_libraries_alone():
    """The forkserver imports the worker before it forks every rank: had that import initialised
    CUDA or loaded Triton or nvshmem4py, every rank would inherit their state across a fork."""
    probe = (
        "import sys, torch, moeserve.distributed.worker; "
        "print(torch.cuda.is_initialized(), sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'nvshmem')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "[]"]
