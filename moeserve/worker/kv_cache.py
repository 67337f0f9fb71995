"""Allocation of the paged KV cache: one tensor per layer, sized in blocks.

Sizing needs only the model's config and the rank's tensor-parallel place, so the process that
schedules (and holds no weights when the model runs in worker processes) can size every data-
parallel group's cache, and each worker allocates exactly what its scheduler planned.
"""

from __future__ import annotations

import logging
import math

import torch

from moeserve.config import CacheConfig, ModelConfig
from moeserve.models import kv_cache_shape

logger = logging.getLogger(__name__)


def bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1, mtp_layers: int = 0
) -> int:
    """KV bytes one block costs on one rank, all layers together (`mtp_layers`: the MTP layers
    loaded to draft, whose KV shares the blocks)."""
    return math.prod(kv_cache_shape(cfg, 1, block_size, tp_size)) * dtype.itemsize * (cfg.num_layers + mtp_layers)


def num_blocks_for(
    cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, max_tokens: int, tp_size: int = 1, mtp_layers: int = 0
) -> int:
    """Blocks that fit the per-rank memory budget, but no more than `max_tokens` (every
    sequence slot at full length) can ever use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    fitting = cache.memory_bytes // bytes_per_block(cfg, cache.block_size, dtype, tp_size, mtp_layers)
    return max(1, min(fitting, -(-max_tokens // cache.block_size)))


def allocate_kv_caches(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
    mtp_layers: int = 0,
) -> list[torch.Tensor]:
    """Zeroed, so a bug that reads an unwritten slot shows up as a wrong token, not as NaN noise.
    The decoder layers' caches, then `mtp_layers` more for the MTP layers loaded to draft."""
    shape = kv_cache_shape(cfg, num_blocks, block_size, tp_size)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers + mtp_layers)]
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %.1f MiB",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * bytes_per_block(cfg, block_size, dtype, tp_size, mtp_layers) / 2**20,
    )
    return caches
