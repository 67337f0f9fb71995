"""Where the model runs for the engine: in this process, or in worker processes (EP/TP).

The engine owns requests, scheduling and detokenization and never touches weights; an
`Executor` turns each step's plan (one per data-parallel group) into sampled tokens. Backends:
`InProcessExecutor` (ep = tp = 1, the model in the engine's thread) and
`MultiprocessExecutor` (`engine/multiproc.py`: one process per rank, all in lockstep).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from moeserve.config import EngineConfig, ModelConfig
from moeserve.dispatch import ExpertPlacement
from moeserve.engine.kv_cache import allocate_kv_caches
from moeserve.engine.runner import ModelRunner, SampledToken, SamplingRequest
from moeserve.engine.stats import RoutedTokens
from moeserve.models import load_model
from moeserve.models.ops import create_ops
from moeserve.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Runs every step's plans; `num_groups` plans per step, each group with `num_kv_blocks`."""

    num_groups: int
    num_kv_blocks: int

    @abstractmethod
    def execute(self, plans: Sequence[SchedulerOutput], requests: Mapping[str, SamplingRequest]) -> dict[str, SampledToken]:
        """Run one lockstep step; a token for every scheduled request whose plan says `sample`."""

    @abstractmethod
    def release(self, request_ids: Sequence[str]) -> None:
        """These requests are done: drop their per-request state (seeded generators)."""

    @abstractmethod
    def take_routed_tokens(self) -> RoutedTokens | None:
        """Expert load since the previous call, or None if nothing new is known yet."""

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` is called once if the executor can no longer run steps (a rank
        process was lost). The in-process executor has no such failure."""

    def shutdown(self) -> None:
        """Stop what the executor started; idempotent."""


class InProcessExecutor(Executor):
    """The whole model in this process (ep = tp = 1): the `local` dispatcher, one group."""

    num_groups = 1

    def __init__(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, num_kv_blocks: int, eos_token_ids: Sequence[int]) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.model = load_model(Path(config.model), dtype, config.device, ops=create_ops(config.kernels, config.device))
        kv_caches = allocate_kv_caches(model_config, num_kv_blocks, config.cache.block_size, dtype, config.device)
        self.runner = ModelRunner(self.model, kv_caches, config.cache.block_size, eos_token_ids, config.device)
        self._placement = ExpertPlacement.contiguous(model_config.num_experts)
        self._moe_layers = model_config.moe_layer_indices

    def execute(self, plans: Sequence[SchedulerOutput], requests: Mapping[str, SamplingRequest]) -> dict[str, SampledToken]:
        (plan,) = plans
        return self.runner.execute(plan, requests)

    def release(self, request_ids: Sequence[str]) -> None:
        self.runner.release(request_ids)

    def take_routed_tokens(self) -> RoutedTokens | None:
        return RoutedTokens(self.model.take_routed_tokens(), self._placement, self._moe_layers)


def create_executor(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, num_kv_blocks: int, eos_token_ids: Sequence[int]) -> Executor:
    """In this process for ep = tp = 1; otherwise one process per rank."""
    if not config.parallel.is_distributed:
        return InProcessExecutor(config, model_config, dtype, num_kv_blocks, eos_token_ids)
    from moeserve.distributed.executor import MultiprocessExecutor

    return MultiprocessExecutor(config, model_config, dtype, num_kv_blocks, eos_token_ids)
