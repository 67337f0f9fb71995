"""The package's shape: light rooms load without torch, and no two rooms import each other.

A room is a first-level subpackage (`moeserve/engine/`) or a top-level module (`moeserve/llm.py`).
Rooms that import each other in a circle can only be understood, tested and changed together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moeserve"


def torch_loaded_after(code: str) -> bool:
    """Whether torch is in sys.modules after `code` runs in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize(
    "code",
    [
        "from moeserve.cli import build_parser; build_parser()",
        "import moeserve.scheduler",
        "import moeserve.engine_config",
    ],
)
def test_light_rooms_load_no_torch(code: str) -> None:
    assert not torch_loaded_after(code)


def test_moeserve_help_loads_no_torch() -> None:
    assert not torch_loaded_after(
        "from moeserve.cli import main\ntry:\n    main(['launch', '--help'])\nexcept SystemExit:\n    pass"
    )


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "moeserve" and len(parts) > 1 else None


def imported_modules(path: Path, module: str) -> set[str]:
    """Every moeserve module `path` imports, relative imports resolved; lazy ones inside functions included."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("moeserve.")}


def room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("moeserve", *path.relative_to(PACKAGE).with_suffix("").parts))
        room = room_of(module)
        if room in ("__init__", "__main__"):  # the lazy front door and the entry point: no room's code
            continue
        targets = {room_of(m) for m in imported_modules(path, module)} - {None, room, "__init__", "__main__"}
        graph.setdefault(room, set()).update(
            t for t in targets if (PACKAGE / t).exists() or (PACKAGE / f"{t}.py").exists()
        )
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of rooms that import each other in a circle, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(room: str) -> list[str] | None:
        state[room] = 1
        path.append(room)
        for target in sorted(graph.get(room, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[room] = 2
        return None

    for room in sorted(graph):
        if room not in state and (cycle := visit(room)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_cycle_between_rooms() -> None:
    graph = room_graph()
    assert {"engine", "scheduler", "cli", "config"} <= set(graph), sorted(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
