"""Run a function on N gloo ranks in fresh processes and collect what each returns.

    from ranks import run_ranks
    results = run_ranks(4, my_module.per_rank_fn, arg1, arg2)   # [rank 0's return, rank 1's, ...]

`fn(rank, world_size, *args)` runs in each process with the default process group already
initialised (gloo, over loopback). It and its arguments and return value must be picklable:
the processes are spawned (never forked: torch and fork do not mix), so `fn` must live in an
importable module, not in a test file's closure. Spawned processes inherit the parent's
`sys.path`, so a helper module next to the test (this folder is on the path under pytest)
imports there as it does here. Each rank gets `cpu_count // world_size` intra-op threads (at
least one); `fn` may set its own.

The parent never hangs: it owns the rendezvous store, waits at most `timeout` seconds, and on
the first failure (an exception, a crash, or the deadline) kills every rank and raises with the
failing rank's traceback. A rank stuck in a collective because its peer died is therefore
killed, not waited for.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.05
_GRACE_S = 1.0  # how long a rank's report may trail its exit before the rank counts as crashed


class RankError(RuntimeError):
    """A rank raised, crashed or did not finish in time; the message carries its traceback."""


def _rank_main(rank: int, world_size: int, port: int, timeout: float, job: bytes, results: Any) -> None:
    """Body of one spawned rank: join the group, run the job, report ("ok", pickled value) or ("error", traceback).

    The job and the value are pickled here, inside the try, so an import or pickling error comes
    back as a traceback instead of a silent exit. The report is flushed before the group is torn
    down: a failing rank's own traceback then reaches the parent ahead of the connection errors
    its teardown causes in its peers.
    """
    try:
        fn, args = pickle.loads(job)
        # Many ranks share few cores: one intra-op pool per rank sized to its share, not one per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        report = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, KeyboardInterrupt included
        report = (rank, "error", traceback.format_exc())
    results.put(report)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return their values by rank.

    Raises RankError naming the first rank that failed (with its traceback), or the ranks that had
    not finished when `timeout` seconds passed; all ranks are dead by the time it raises.
    """
    ctx = mp.get_context("spawn")
    # The parent hosts the store on a port the OS picks, so there is no free-port race to lose.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )
    job = pickle.dumps((fn, args))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, store.port, timeout, job, results), name=f"rank{rank}")
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    started: list[BaseProcess] = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        while len(values) < world_size:
            try:
                rank, status, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    pending = [r for r in range(world_size) if r not in values]
                    raise RankError(f"ranks {pending} of {world_size} did not finish within {timeout:g} s") from None
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode is not None and now - exited_at.setdefault(r, now) > _GRACE_S:
                        raise RankError(
                            f"rank {r} of {world_size} exited with code {p.exitcode} without reporting"
                        ) from None
                continue
            if status == "error":
                raise RankError(f"rank {rank} of {world_size} failed:\n{payload}{_silent_exits(procs, values)}")
            values[rank] = pickle.loads(payload)
        for p in started:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join()
        results.close()
    return [values[rank] for rank in range(world_size)]


def _silent_exits(procs: list[BaseProcess], values: dict[int, Any]) -> str:
    """A note on ranks that already exited without reporting: often the real cause of a peer's error."""
    dead = [
        f"rank {r} exited with code {p.exitcode}"
        for r, p in enumerate(procs)
        if r not in values and p.exitcode not in (None, 0)
    ]
    return f"\n(meanwhile, without reporting: {', '.join(dead)})" if dead else ""
