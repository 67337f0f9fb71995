"""Which CPUs the engine core and the HTTP process get (`engine/cpu_binding.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from moeserve.engine.cpu_binding import CpuBinding, plan_cpu_binding


def test_auto_leaves_the_last_cpu_to_the_http_process() -> None:
    assert plan_cpu_binding("auto", "cpu", 1, [3, 0, 1, 2]) == CpuBinding(engine=(0, 1, 2), frontend=(3,))
    assert plan_cpu_binding("auto", "cpu", 1, {4, 5}) == CpuBinding(engine=(4,), frontend=(5,))


@pytest.mark.parametrize(
    ("mode", "device", "world_size", "cpus"),
    [
        ("off", "cpu", 1, range(8)),  # asked not to
        ("auto", "cuda:0", 1, range(8)),  # the model is on a GPU: the core's CPU work is launches
        ("auto", "cpu", 4, range(8)),  # rank processes share the CPUs among themselves
        ("auto", "cpu", 1, [0]),  # nothing to split
    ],
)
def test_no_binding_where_it_would_not_help(mode: str, device: str, world_size: int, cpus: range) -> None:
    assert plan_cpu_binding(mode, device, world_size, cpus) is None  # type: ignore[arg-type]


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of auto, off"):
        plan_cpu_binding("pin", "cpu", 1, range(2))  # type: ignore[arg-type]


def test_describe_prints_kernel_style_cpu_lists() -> None:
    binding = CpuBinding(engine=(0, 1, 2, 5, 7, 8), frontend=(9,))
    assert binding.describe() == "engine core on CPUs 0-2,5,7-8, HTTP server on CPU 9"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind to one")
def test_binding_reaches_threads_already_running_and_their_children() -> None:
    cpu = max(os.sched_getaffinity(0))
    script = textwrap.dedent(
        f"""
        import os, threading
        from moeserve.engine.cpu_binding import bind_current_process
        seen = {{}}
        started, go = threading.Event(), threading.Event()
        def early():
            started.set(); go.wait()
            seen["early"] = os.sched_getaffinity(0)
            child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
            child.start(); child.join()
        thread = threading.Thread(target=early); thread.start(); started.wait()
        bind_current_process([{cpu}])
        go.set(); thread.join()
        assert seen == {{"early": {{{cpu}}}, "child": {{{cpu}}}}}, seen
        assert os.sched_getaffinity(0) == {{{cpu}}}
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
