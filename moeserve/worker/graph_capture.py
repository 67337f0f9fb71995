"""How a decode step is captured and replayed: CUDA graphs on a GPU, an emulation on a CPU.

`DecodeGraphs` (`decode_graphs.py`) owns what is the same everywhere (buffers, padding, which
size runs); a `GraphBackend` only turns a warmed-up callable into something replayable:

- `CudaGraphBackend`: `torch.cuda.CUDAGraph`, every size captured into one memory pool (largest
  first, so the smaller sizes reuse the largest one's blocks), on a side stream, as vLLM and
  SGLang do. Capture runs no kernels; replay runs exactly the captured kernels over the same
  addresses, so whatever the callable computed from Python state is frozen at capture.
- `EmulatedGraphBackend`: "captures" by keeping the callable and "replays" by calling it again.
  The callable reads only the persistent buffers, exactly as a graph would, so on a CPU this
  exercises everything but the capture itself: the copy into the buffers, the padding, the pad
  rows' scratch slot and the slicing of the output.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CapturedStep(ABC):
    """One captured decode step: replay() recomputes its outputs from its buffers' current values."""

    @abstractmethod
    def replay(self) -> None: ...


class GraphBackend(ABC):
    name: str

    @abstractmethod
    def capture(self, step: Callable[[], None]) -> CapturedStep:
        """Capture `step`, already run once outside capture (so kernels are compiled and every
        lazily allocated workspace exists), with its inputs and outputs in persistent buffers."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Device memory the process holds now, to log what capture costs."""


class _EmulatedStep(CapturedStep):
    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step

    def replay(self) -> None:
        self._step()


class EmulatedGraphBackend(GraphBackend):
    """The CPU stand-in: replay re-runs the callable over the same buffers."""

    name = "emulated"

    def capture(self, step: Callable[[], None]) -> CapturedStep:
        return _EmulatedStep(step)

    def memory_bytes(self) -> int:
        return 0


class _CudaStep(CapturedStep):
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self._graph = graph

    def replay(self) -> None:
        self._graph.replay()


class CudaGraphBackend(GraphBackend):
    """CUDA graphs sharing one memory pool. Capture on a side stream (the default stream cannot
    be captured), after syncing it with the current stream; replay on the current stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def capture(self, step: Callable[[], None]) -> CapturedStep:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            step()
        torch.cuda.synchronize(self.device)
        return _CudaStep(graph)

    def memory_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


def graph_backend_for(device: torch.device, emulate: bool) -> GraphBackend:
    """CUDA graphs on a CUDA device; the emulation where asked for (tests, on a CPU)."""
    if emulate:
        return EmulatedGraphBackend()
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    return CudaGraphBackend(device)
