"""With the model on CPU, the server keeps its HTTP process and the engine core on different CPUs,
and the core sizes its torch pool to its own CPUs (`engine/cpu_binding.py`)."""

from __future__ import annotations

import os
import re

import pytest
from server_utils import core_pid


def allowed_cpus(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs to split")
def test_core_and_http_process_run_on_separate_cpus(start_server) -> None:
    server = start_server()
    pid = core_pid(server.log())
    core, frontend = allowed_cpus(pid), allowed_cpus(server.proc.pid)
    assert core and frontend and not core & frontend
    assert core | frontend == os.sched_getaffinity(0)
    assert len(frontend) == 1
    assert re.search(r"CPU binding: engine core on CPUs [\d,-]+, HTTP server on CPU \d+", server.log())
    assert server.stop() == 0
