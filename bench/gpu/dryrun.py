"""The runbook's dry run: every stage's real command line, checked as far as a CPU machine allows,
so that a typo or a broken import shows here rather than in lent device time.

A script is loaded (its imports run) and its own `parse_args` reads the stage's arguments, then
its `check_commands` parses whatever it would start (the serve stage's `moeserve launch` and
`moeserve bench serve`). A pytest command collects its tests in this process: the marker
expression must select at least one test and every module must import. One process does it all,
so torch and transformers are imported once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

from stages import Pytest, Script

ROOT = Path(__file__).resolve().parents[2]


class CheckFailed(Exception):
    """A stage's command line would fail on the device."""


def load_script(path: Path) -> ModuleType:
    """The script at `path` as a module (bench/ is no package), loaded once."""
    name = f"runbook_{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise CheckFailed(f"{path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise CheckFailed(f"{path.relative_to(ROOT)}: importing it failed: {type(e).__name__}: {e}") from e
    return sys.modules[name]


def check_script(command: Script, argv: list[str]) -> str:
    """Parse `argv` (the stage's arguments and its --out) with the script's own parser."""
    path = ROOT / command.path
    if not path.is_file():
        raise CheckFailed(f"{command.path}: no such file")
    module = load_script(path)
    if not hasattr(module, "parse_args"):
        raise CheckFailed(f"{command.path}: has no parse_args(argv) for the dry run to call")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = module.parse_args(argv)
    except SystemExit as e:
        raise CheckFailed(f"{command.path} {' '.join(argv)}: {errors.getvalue().strip() or e}") from None
    detail = f"{command.path}: arguments parse"
    if hasattr(module, "check_commands"):
        try:
            with contextlib.redirect_stderr(errors):
                module.check_commands(args)
        except (SystemExit, ValueError) as e:
            raise CheckFailed(f"{command.path}: a command it starts: {errors.getvalue().strip() or e}") from None
        detail += ", and so do the commands it starts"
    return detail


class _Collected:
    """A pytest plugin that keeps the ids of the collected (selected) tests."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def pytest_collection_finish(self, session) -> None:
        self.ids = [item.nodeid for item in session.items]


def check_pytest(command: Pytest, argv: list[str], targets: list[str], log: io.TextIOBase) -> str:
    """Collect the command's tests in this process with its own pytest arguments `argv`; at least
    one test must be selected."""
    import pytest

    missing = [t for t in targets if not (ROOT / t.split("::", 1)[0]).exists()]
    if missing:
        raise CheckFailed(f"pytest targets missing: {', '.join(missing)}")
    collected = _Collected()
    with contextlib.redirect_stdout(log):  # the runbook works in the repository root
        code = pytest.main([*argv, "--collect-only"], plugins=[collected])
    if code != 0 or not collected.ids:
        found = len(collected.ids)
        raise CheckFailed(f"pytest -m {command.marker!r}: collection exited {int(code)} with {found} tests")
    return f"pytest -m {command.marker!r}: {len(collected.ids)} tests in {len(targets)} files collect"
