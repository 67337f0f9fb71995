"""Every example the documentation shows runs, against a real server on the test checkpoint.

The pages include their examples from `docs/examples/` (pymdownx.snippets), so what a reader
copies is what runs here. An example's first line names the server it talks to
(`# Server: moeserve launch [FLAGS]`), and the example gets its URL in `$MOESERVE_URL`
(`$MOESERVE_MODEL`: the checkpoint, for `LLM`); examples without that line run offline. To keep
to two server start-ups, examples share one server launched with all their flags, which only add
(a tool parser, SLO classes); a reasoning parser changes how every answer reads (a grammar may
open a thinking block first), so an example asking for one gets a server of its own. Printed
results are random-weight text; what is checked is that each example runs to the end (its own
`json.loads` and lookups included) and prints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_utils import ServerProcess

DOCS = Path(__file__).resolve().parents[2] / "docs"
SERVER_LINE = "# Server: moeserve launch"
CONTEXT = 2048  # tool signatures take several hundred tokens of the test checkpoint's byte-level vocabulary
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Contributor notes that show internals rather than user examples.
UNEXECUTED_PAGES = {"architecture.md"}
# Flags that change how every answer reads: an example naming one gets a server of its own.
OWN_SERVER_FLAGS = ("--reasoning-parser",)


def server_flags(example: Path) -> tuple[str, ...] | None:
    first = example.read_text().splitlines()[0]
    if not first.startswith(SERVER_LINE):
        return None
    return tuple(shlex.split(first.removeprefix(SERVER_LINE)))


# Offline examples first: they run while the servers load (started by the first test, awaited
# by the first example that talks to one).
EXAMPLES = sorted(
    (p for p in (DOCS / "examples").iterdir() if p.suffix in (".py", ".sh")),
    key=lambda p: (server_flags(p) is not None, p.name),
)


def server_key(flags: tuple[str, ...]) -> tuple[str, ...]:
    """Which server an example with `flags` talks to: its own flags, or () for the shared one."""
    return flags if any(flag in OWN_SERVER_FLAGS for flag in flags) else ()


def launch_flags(key: tuple[str, ...]) -> tuple[str, ...]:
    """The shared server takes the flags of every example it serves, each set once."""
    if key:
        return key
    distinct = dict.fromkeys(flags for e in EXAMPLES if (flags := server_flags(e)) and not server_key(flags))
    return tuple(arg for flags in distinct for arg in flags)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("qwen3_moe", 0, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def servers(
    start_server: Callable[..., ServerProcess], checkpoint: Path
) -> Iterator[dict[tuple[str, ...], ServerProcess]]:
    keys = sorted({server_key(flags) for e in EXAMPLES if (flags := server_flags(e)) is not None})
    started = {
        key: start_server(*launch_flags(key), "--max-model-len", str(CONTEXT), checkpoint=checkpoint, wait=False)
        for key in keys
    }
    yield started
    with ThreadPoolExecutor(len(started)) as pool:  # each drains for seconds: side by side
        list(pool.map(ServerProcess.stop, started.values()))


@pytest.fixture(scope="module")
def command_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `moeserve` command on PATH that runs this checkout with this interpreter, as the
    examples' shell commands call it."""
    folder = tmp_path_factory.mktemp("bin")
    command = folder / "moeserve"
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m moeserve "$@"\n')
    command.chmod(0o755)
    return folder


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(
    example: Path, servers: dict[tuple[str, ...], ServerProcess], checkpoint: Path, command_dir: Path
) -> None:
    env = {
        **os.environ,
        "PATH": f"{command_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "MOESERVE_MODEL": str(checkpoint),
    }
    flags = server_flags(example)
    if flags is not None:
        server = servers[server_key(flags)]
        server.wait_healthy()
        env["MOESERVE_URL"] = server.url
    command = [sys.executable, str(example)] if example.suffix == ".py" else ["bash", "-euo", "pipefail", str(example)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    output = f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{example.name} exited {result.returncode}\n{output}"
    assert result.stdout.strip(), f"{example.name} printed nothing"


def _pages() -> list[Path]:
    return [p for p in DOCS.rglob("*.md") if p.name not in UNEXECUTED_PAGES]


def test_every_example_is_shown() -> None:
    """An example no page includes is tested but never read: a page lost it, or it is dead."""
    shown = {name for page in _pages() for name in SNIPPET.findall(page.read_text())}
    assert sorted(e.name for e in EXAMPLES if e.name not in shown) == []


def test_pages_show_examples_only_from_files() -> None:
    """A client example typed into a page would not run here: it belongs in docs/examples/."""
    typed = []
    for page in _pages():
        for block in FENCE.findall(page.read_text()):
            if SNIPPET.fullmatch(block.strip()) is None and re.search(r"curl |OpenAI\(|\bLLM\(", block):
                typed.append(f"{page.relative_to(DOCS)}: {block.strip().splitlines()[0]}")
    assert typed == []
