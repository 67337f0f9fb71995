"""Which CPUs the server's two processes use when the model runs on CPU.

The engine core steps the model with a pool of torch threads; the API process answers HTTP,
tokenizes and detokenizes. Left to the OS on a small machine, both want every core: torch's
threads spin at their barriers while the API process holds a core, and a step that should take
milliseconds waits for a thread the OS parked (measured on 2 cores under `vllm bench serve`:
25-50x slower steps than with the two kept apart). vLLM's CPU build keeps them apart too: its
engine threads are bound to cores and one CPU is left to the frontend.

`auto` gives the API process the last CPU it may use and the core every other one, with one torch
thread per CPU. Only where the core runs the model itself (one rank): rank processes share the
node's CPUs among themselves (`distributed.worker.rank_device`), and a scheduler-only core needs
no cores of its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

CpuBindingMode = Literal["auto", "off"]


@dataclass(frozen=True)
class CpuBinding:
    """engine: the CPUs of the engine core process and its torch threads; frontend: the API
    process's (HTTP, tokenizer, detokenizer), and those of the engine core's socket threads."""

    engine: tuple[int, ...]
    frontend: tuple[int, ...]

    def describe(self) -> str:
        return f"engine core on CPUs {_cpu_list(self.engine)}, HTTP server on CPU {_cpu_list(self.frontend)}"


def plan_cpu_binding(mode: CpuBindingMode, device: str, world_size: int, available: Iterable[int]) -> CpuBinding | None:
    """The binding for a server whose model runs on `device` over `world_size` ranks, given the
    CPUs this process may use; None where the OS should schedule as it likes."""
    if mode not in ("auto", "off"):
        raise ValueError(f"cpu_binding {mode!r} is not one of auto, off")
    cpus = sorted(set(available))
    if mode == "off" or not device.startswith("cpu") or world_size > 1 or len(cpus) < 2:
        return None
    return CpuBinding(engine=tuple(cpus[:-1]), frontend=(cpus[-1],))


def bind_current_process(cpus: Iterable[int]) -> None:
    """Restrict every thread of this process (Linux affinity is per thread) to `cpus`; threads
    started later inherit it from their parent thread."""
    cpu_set = set(cpus)
    try:
        thread_ids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        thread_ids = [0]  # no procfs: the calling thread only
    for tid in thread_ids:
        try:
            os.sched_setaffinity(tid, cpu_set)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _cpu_list(cpus: tuple[int, ...]) -> str:
    """'0-2,5' for (0, 1, 2, 5), as the kernel prints CPU lists."""
    ranges: list[list[int]] = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
