"""Starting a node's rank processes, and the process that minds them on nodes other than 0.

Ranks are numbered node by node: node n runs ranks [n * L, (n + 1) * L) with L = ep / nnodes,
each on its node's `local_rank`-th device. Each is forked from a warm process that has only
imported the worker (`processes.py`), not from this one: CUDA and the process groups are set up
in a clean process, and a crash of one rank never takes its siblings' memory with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from moeserve.config import ParallelConfig
from moeserve.distributed.node_network import use_node_network
from moeserve.distributed.node_watch import NodeZeroWatch
from moeserve.distributed.processes import ChildProcess, start_process

logger = logging.getLogger(__name__)


def node_ranks(parallel: ParallelConfig, node_rank: int) -> range:
    per_node = parallel.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def start_ranks(
    parallel: ParallelConfig, master_addr: str, master_port: int, node_rank: int, watch_parent: bool
) -> dict[int, ChildProcess]:
    """Start this node's ranks; with `watch_parent` each exits when this process is gone."""
    procs = {
        rank: start_rank(rank, local_rank, master_addr, master_port, node_rank, watch_parent)
        for local_rank, rank in enumerate(node_ranks(parallel, node_rank))
    }
    logger.info(
        "node %d: started ranks %d-%d (pids %s)",
        node_rank,
        min(procs),
        max(procs),
        ", ".join(str(p.pid) for p in procs.values()),
    )
    return procs


def start_rank(
    rank: int, local_rank: int, master_addr: str, master_port: int, node_rank: int, watch_parent: bool
) -> ChildProcess:
    """One rank process, with the flags it is started with at launch and on a restart alike."""
    argv = [
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--rank",
        str(rank),
        "--local-rank",
        str(local_rank),
        "--node-rank",
        str(node_rank),
        "--log-level",
        logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    ]
    if watch_parent:
        argv += ["--parent-pid", str(os.getpid())]
    return start_process("moeserve.distributed.worker", argv)


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_ranks(procs: dict[int, ChildProcess], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whoever is left after `grace_s` (a stopped process ignores SIGTERM)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_node(parallel: ParallelConfig) -> int:
    """A node other than 0: run its ranks until they end; exit non-zero if any failed.

    Node 0 drives them. When it stops it says so and this node follows: exit 0 after a clean stop
    (its ranks were told to finish), 1 after a failure. When it is silent for
    `--heartbeat-timeout` (gone, frozen, or the network cut) the ranks are stopped and this
    process exits 1: a rank blocked on a peer that is gone never gets out on its own. SIGTERM and
    SIGINT stop the ranks.
    """
    use_node_network(parallel)
    procs = start_ranks(parallel, parallel.master_addr, parallel.master_port, parallel.node_rank, watch_parent=True)
    logger.info("node %d: ranks join node 0 at %s:%d", parallel.node_rank, parallel.master_addr, parallel.master_port)
    watch = NodeZeroWatch(parallel)
    stopping = False

    def stop(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        logger.info("received %s: stopping this node's ranks", signal.Signals(sig).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    worst = 0
    while procs and not stopping and watch.leaving is None:
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[rank]
            if code:
                logger.error("rank %d %s", rank, exit_description(code))
                worst = worst or 1
        lost = watch.lost()
        if lost is not None:
            logger.error("node %d: %s; stopping this node's ranks", parallel.node_rank, lost)
            worst = 1
            break
        time.sleep(0.2)
    if watch.leaving is not None:
        leaving = watch.leaving
        logger.info("node %d: node 0 is stopping (%s): so does this node", parallel.node_rank, leaving.reason)
        if leaving.clean:  # the ranks were told to finish: give them the time node 0 gives its own
            deadline = time.monotonic() + 10.0
            while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            worst = 1
    watch.close()
    stop_ranks(procs, grace_s=2.0)
    logger.info("node %d: ranks stopped; exiting %d", parallel.node_rank, worst)
    return worst
