"""Decode steps replayed from captured graphs: persistent buffers, padding, capture, replay.

A decode step (every sequence brings one token) of n sequences runs as the captured step of the
smallest size B >= n (and >= the step's bound at ep > 1, so every rank of the EP group replays
the same size and joins the same collectives): the runner writes the n sequences' token ids,
positions, new-token slots, block tables and context lengths into the first n rows of the
persistent buffers, fills rows n..B with pad rows, replays, and keeps the first n rows of the
hidden-state buffer. Sampling stays outside, as in vLLM.

Pad rows: token 0 at position 0 with a context of one token in the scratch block, a cache block
the scheduler never hands out (the cache is allocated one block larger). Their K/V land there and
their attention reads only there, so no real block is touched; the MoE load counters skip them
(`MoECausalLM.counting_rows`).

Capture (vLLM's and SGLang's order): every buffer and the output are allocated first; each size,
largest first, runs once eagerly (compiling kernels, making lazily allocated workspaces) and is
then captured, all sizes into one memory pool, so the smaller ones reuse the largest one's blocks.
What the captured step computes from Python state (launch grids, the step bound, the attention
plan's shapes) is fixed at capture, so it reads nothing else: `LayerOps.decode_graph_planner`
fixes the attention plan's shapes for the longest context (`max_context_len`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeserve.engine_config import CudaGraphConfig
from moeserve.models import MoECausalLM
from moeserve.ops.attention import DecodeGraphInputs
from moeserve.ops.state_batch import LinearState
from moeserve.scheduler import ScheduledRequest
from moeserve.worker.graph_capture import CapturedStep, GraphBackend, graph_backend_for

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class GraphSettings:
    """What of the engine's layout decides whether and what a runner captures."""

    device: str
    max_num_seqs: int
    """No decode step has more sequences: larger sizes are not captured."""
    max_model_len: int
    """The longest context a sequence reaches: the captured attention is shaped for it."""
    tp_size: int = 1
    two_batch_overlap: bool = False
    eplb: bool = False
    """Live expert rebalancing is on."""


def is_decode(scheduled: Sequence[ScheduledRequest]) -> bool:
    """Whether every sequence brings exactly one token (a prompt's last token of a chunked
    prefill counts: it is computed exactly as a decode is)."""
    return all(len(s.token_ids) == 1 for s in scheduled)


class DecodeGraphs:
    """Captured decode steps of `model` at each of `sizes`, over `kv_caches`.

    block_size / max_context_len: the cache's block size and the longest context a sequence may
    reach (max_model_len). scratch_block: a block of `kv_caches` no sequence is ever given.
    """

    def __init__(
        self,
        model: MoECausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_context_len: int,
        scratch_block: int,
        sizes: Sequence[int],
        backend: GraphBackend,
        device: torch.device,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graphs need positive batch sizes, got {list(sizes)}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_context_len = max_context_len
        self.scratch_block = scratch_block
        self.sizes = tuple(sorted(set(sizes)))
        self.backend = backend
        self.device = device
        largest = self.sizes[-1]
        width = -(-max_context_len // block_size)  # W: blocks of the longest context
        # B = the largest size; each captured size reads the first rows of these.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)  # [B]
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)  # [B]
        self.slot_mapping = torch.zeros(largest, dtype=torch.int64, device=device)  # [B]
        self.block_table = torch.zeros(largest, width, dtype=torch.int32, device=device)  # [B, W]
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)  # [B]
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)  # [B + 1]
        self.counted = torch.zeros(largest, dtype=torch.bool, device=device)  # [B]: real rows
        self.hidden = torch.zeros(largest, model.cfg.hidden_size, dtype=model.dtype, device=device)  # [B, H]
        self._steps: dict[int, CapturedStep] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first; logs the time and device memory it took."""
        self._write_pads(0, self.sizes[-1])
        memory_before, started = self.backend.memory_bytes(), time.perf_counter()
        for size in reversed(self.sizes):
            step = self._step(size)
            step()  # warm-up, outside capture
            self._steps[size] = self.backend.capture(step)
        logger.info(
            "decode graphs (%s): %d sizes from %d to %d captured in %.2f s, %.1f MiB of device memory",
            self.backend.name,
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - started,
            (self.backend.memory_bytes() - memory_before) / 2**20,
        )

    def size_for(self, num_seqs: int, max_tokens_per_rank: int | None) -> int | None:
        """The captured size a decode step of `num_seqs` sequences replays (at least the step's
        bound, which every rank of the EP group shares), or None: too large, run it eagerly."""
        needed = max(num_seqs, max_tokens_per_rank or 0)
        return next((s for s in self.sizes if s >= needed), None)

    def run(self, scheduled: Sequence[ScheduledRequest], size: int) -> torch.Tensor:
        """Hidden states `[n, H]` of the n decodes `scheduled`, replayed at `size` (>= n)."""
        n = len(scheduled)
        if n > size or size not in self._steps:
            raise ValueError(f"no captured decode step of size {size} for {n} sequences")
        self._write_rows(scheduled)
        self._write_pads(n, size)
        self._steps[size].replay()
        return self.hidden[:n]

    def _step(self, size: int) -> Callable[[], None]:
        """The captured callable of one size: the model over the buffers' first `size` rows into
        `hidden`; it reads nothing but the buffers (and the weights and caches)."""
        inputs = DecodeGraphInputs(
            slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size],
            context_lens=self.context_lens[:size],
            query_start=self.query_start[: size + 1],
            block_size=self.block_size,
            max_context_len=self.max_context_len,
        )
        plan = self.model.ops.decode_graph_planner(inputs)
        input_ids, positions, counted, hidden = (
            self.input_ids[:size],
            self.positions[:size],
            self.counted[:size],
            self.hidden[:size],
        )

        def step() -> None:
            with self.model.counting_rows(counted):
                out = self.model(input_ids, positions, plan(), self.kv_caches, size)  # [size, H]
            hidden.copy_(out)

        return step

    def _write_rows(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The real rows: one upload per buffer. A block table row is written only as wide as the
        step's widest (the rest is stale, and no kernel reads past a sequence's own blocks)."""
        n, bs = len(scheduled), self.block_size
        if n == 0:
            return
        positions = [s.start_position for s in scheduled]
        rows = torch.tensor(
            [
                [s.token_ids[0] for s in scheduled],
                positions,
                [s.block_ids[p // bs] * bs + p % bs for s, p in zip(scheduled, positions)],
                [p + 1 for p in positions],
            ],
            dtype=torch.int64,
        ).to(self.device)  # [4, n]
        self.input_ids[:n].copy_(rows[0])
        self.positions[:n].copy_(rows[1])
        self.slot_mapping[:n].copy_(rows[2])
        self.context_lens[:n].copy_(rows[3])
        self.counted[:n] = True
        width = max(-(-(p + 1) // bs) for p in positions)
        table = [s.block_ids[:width] + [0] * (width - min(width, len(s.block_ids))) for s in scheduled]
        self.block_table[:n, :width].copy_(torch.tensor(table, dtype=torch.int32))

    def _write_pads(self, start: int, stop: int) -> None:
        """Rows [start, stop) become pad rows: token 0 at position 0 of the scratch block."""
        if start >= stop:
            return
        self.input_ids[start:stop] = PAD_TOKEN_ID
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = self.scratch_block * self.block_size
        self.context_lens[start:stop] = 1
        self.counted[start:stop] = False
        self.block_table[start:stop, 0] = self.scratch_block


def create_decode_graphs(
    model: MoECausalLM,
    kv_caches: list[torch.Tensor | LinearState],
    block_size: int,
    scratch_block: int,
    config: CudaGraphConfig,
    settings: GraphSettings,
) -> DecodeGraphs | None:
    """Captured decode graphs for this runner, or None (and the reason logged once) where the
    config or the layout rules them out: sizes whose step bound the dispatcher cannot capture
    are dropped."""
    device = torch.device(settings.device)
    reason = graph_refusal(config, device, settings)
    if reason is None and not all(isinstance(c, torch.Tensor) for c in kv_caches):
        reason = "a layer's cache is not one tensor (Gated DeltaNet states, DSA indexer keys): not captured"
    sizes = config.capture_sizes(settings.max_num_seqs)
    if reason is None:
        dispatcher = model.moe_blocks()[0].dispatcher if model.moe_blocks() else None
        refused = {s: dispatcher.graph_capture_refusal(s) for s in sizes} if dispatcher is not None else {}
        dropped = [s for s, why in refused.items() if why is not None]
        if dropped:
            logger.info("decode graphs: sizes %s run eagerly: %s", dropped, refused[dropped[0]])
        sizes = tuple(s for s in sizes if s not in dropped)
        if not sizes:
            reason = "no batch size is left to capture"
    if reason is not None:
        _log_once(f"decode graphs off, every step runs eagerly: {reason}")
        return None
    graphs = DecodeGraphs(
        model,
        kv_caches,
        block_size,
        settings.max_model_len,
        scratch_block,
        sizes,
        graph_backend_for(device, config.emulate),
        device,
    )
    graphs.capture()
    return graphs


def graph_refusal(config: CudaGraphConfig, device: torch.device, settings: GraphSettings) -> str | None:
    """Why this runner captures no decode graphs, or None."""
    if config.enforce_eager:
        return "--enforce-eager"
    if not config.wanted(str(device)):
        return f"CUDA graphs run on CUDA devices only (device {device})"
    if settings.tp_size > 1:
        return "tensor parallelism (tp > 1) is not captured yet"
    if settings.two_batch_overlap:
        return "two-batch overlap interleaves two passes, which one graph per step cannot"
    if settings.eplb:
        return "live expert rebalancing replaces the replica tables a graph would have captured"
    return None


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
