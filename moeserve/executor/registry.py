"""The executor for a parallel layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeserve.config import EngineConfig, ModelConfig
from moeserve.executor.base import Executor
from moeserve.executor.in_process import InProcessExecutor


def create_executor(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    num_kv_blocks: int,
    eos_token_ids: Sequence[int],
) -> Executor:
    """In this process for ep = tp = 1; otherwise one process per rank."""
    if not config.parallel.is_distributed:
        return InProcessExecutor(config, model_config, dtype, num_kv_blocks, eos_token_ids)
    from moeserve.executor.multiproc import MultiprocessExecutor

    return MultiprocessExecutor(config, model_config, dtype, num_kv_blocks, eos_token_ids)
