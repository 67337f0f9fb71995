"""Fixtures that start the real server (see `server_utils`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_utils import MAX_MODEL_LEN, ServerProcess


@pytest.fixture(scope="session")
def server_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen3_moe", 0)


@pytest.fixture(scope="session")
def start_server(
    tmp_path_factory: pytest.TempPathFactory, server_checkpoint: Path
) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(*extra_args, env=None, checkpoint=None) -> a healthy server on the test
    checkpoint (or `checkpoint`); all are stopped at the end of the session. `extra_args` come
    last, so they override the defaults (`--max-model-len`)."""
    started: list[ServerProcess] = []

    def start(
        *extra: str, env: dict[str, str] | None = None, wait: bool = True, checkpoint: Path | None = None
    ) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        args = [
            "--model",
            str(checkpoint or server_checkpoint),
            "--served-model-name",
            "tiny",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *extra,
        ]
        server = ServerProcess(args, log, env)
        started.append(server)
        if wait:
            server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess]) -> Iterator[ServerProcess]:
    """One default server, shared by a test module."""
    server = start_server()
    yield server
    server.stop()
