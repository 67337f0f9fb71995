"""Starting child processes as forks of one warm process that has imported their modules already.

A fresh interpreter pays the torch import, seconds of CPU, per process: at ep=8 on a small host
that is most of the start-up, and it is what a healed or returning rank would wait on before it
serves again. Python's `forkserver` start method keeps what a fresh interpreter gave us, and
drops that cost: every child is forked from a single-threaded server process that has done
nothing but import the worker's modules (no CUDA context, no process group, no thread pool, no
socket), so a crash of one rank still cannot touch another's memory. The server is started on
the first call, costs one import, and goes away with the process that started it. The API
server's grammar compile workers are forked from it as well (`forkserver_context`): a worker
killed for an overdue compile is back in milliseconds, not after its own torch import.

A child takes the caller's environment as it is at the call (not the server's, which is the
caller's from when the server started), as `subprocess.Popen` would have given it.

`multiprocessing` imports the caller's main module again in every child unless it is a
package's `__main__` (`python -m moeserve`, `python -m pytest`): a user's script that builds an
`LLM(ep=4)` without an `if __name__ == "__main__"` guard would then run again in each rank.
Such callers get a fresh interpreter (`python -m module`) per child instead, as before: slower
to start, never surprising.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
from typing import Protocol

RANK_MODULE = "moeserve.distributed.worker"  # imports torch and everything a rank runs
_preload: list[str] = []  # what the forkserver imports when it starts, in the order asked for
# `multiprocessing` reads a forkserver child's exit status from a pipe once: two threads reading
# it at once (the rank monitor's poll and a start's cleanup of finished children) could lose it.
_STATUS_LOCK = threading.Lock()


def forkserver_context(*modules: str) -> multiprocessing.context.BaseContext:
    """The forkserver start method, its server importing `modules` before it forks anything.
    A process has one forkserver, started with its first child: modules asked for by then are
    imported once, in the server; any asked for later are imported by each child that runs them,
    which is correct, only slower."""
    _preload.extend(module for module in modules if module not in _preload)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_preload))
    return ctx


def child_context(*modules: str) -> multiprocessing.context.BaseContext:
    """Where to start a `multiprocessing` child that runs `modules`: the forkserver (see
    `forkserver_context`) where the caller's main module allows it, else a fresh interpreter
    (spawn), as `start_process` falls back to `python -m`."""
    return forkserver_context(*modules) if _main_reimport_is_safe() else multiprocessing.get_context("spawn")


def _run(module: str, argv: list[str], environ: dict[str, str], stdin: bytes) -> None:
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [module, *argv]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    # multiprocessing refuses children to a daemonic process, lest they be orphaned when it is
    # terminated; ours watch whoever started them (`started_by`) and leave with it, and the
    # engine core starts its ranks. The flag still has this child terminated at our exit.
    multiprocessing.current_process().daemon = False
    sys.exit(importlib.import_module(module).main(argv))


class ChildProcess(Protocol):
    """The part of `subprocess.Popen`'s interface our launchers and monitors use."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ForkedChild:
    """`ChildProcess` over a forkserver child."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid  # type: ignore[return-value]  # set once started

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        with _STATUS_LOCK:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        multiprocessing.connection.wait([self._process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def _parent_of(pid: int) -> int | None:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # "pid (comm) state ppid ...": comm may hold spaces
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def started_by(pid: int) -> bool:
    """Whether the process `pid` started this one and is still there: it is our parent, or the
    parent of the forkserver we were forked from. Either way, if it dies its child is handed to
    another parent, so a reused pid cannot pass for it."""
    parent = os.getppid()
    return parent == pid or _parent_of(parent) == pid


def _main_reimport_is_safe() -> bool:
    """Whether a forkserver child may import this process's main module (see the module doc)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:  # python -m NAME: a package's __main__ is left alone, our modules are guarded
        return spec.name.endswith("__main__") or spec.name.startswith("moeserve.")
    return getattr(main, "__file__", None) is None  # python -c, a REPL, a notebook: nothing to import


def start_process(module: str, argv: list[str], stdin: bytes = b"", preload: str = RANK_MODULE) -> ChildProcess:
    """Run `module.main(argv)` as `python -m module argv` would (`main`'s return value is the exit
    code), reading `stdin` from its standard input, forked from the warm server (which imports
    `preload`, see `forkserver_context`) where the caller allows it. A forked child is daemonic:
    if this process exits without stopping it, it is sent SIGTERM."""
    if not _main_reimport_is_safe():
        child = subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.PIPE)
        child.stdin.write(stdin)  # type: ignore[union-attr]  # a pipe, asked for above
        child.stdin.close()  # type: ignore[union-attr]
        return child
    context = forkserver_context(preload)
    process = context.Process(target=_run, args=(module, argv, dict(os.environ), stdin), name=module, daemon=True)
    with _STATUS_LOCK:
        process.start()
    return ForkedChild(process)
