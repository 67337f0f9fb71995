"""Allocation of the paged KV cache: one tensor per layer, sized in blocks."""

from __future__ import annotations

import logging
import math

import torch

from moeserve.config import CacheConfig
from moeserve.models import MoECausalLM

logger = logging.getLogger(__name__)


def bytes_per_block(model: MoECausalLM, block_size: int, dtype: torch.dtype) -> int:
    per_layer = math.prod(model.kv_cache_shape(1, block_size)) * dtype.itemsize
    return per_layer * len(model.layers)


def num_blocks_for(model: MoECausalLM, cache: CacheConfig, dtype: torch.dtype, max_tokens: int) -> int:
    """Blocks that fit the memory budget, but no more than `max_tokens` (every sequence slot
    at full length) can ever use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    fitting = cache.memory_bytes // bytes_per_block(model, cache.block_size, dtype)
    return max(1, min(fitting, -(-max_tokens // cache.block_size)))


def allocate_kv_caches(model: MoECausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zeroed, so a bug that reads an unwritten slot shows up as a wrong token, not as NaN noise."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %.1f MiB",
        num_blocks, block_size, num_blocks * block_size, num_blocks * bytes_per_block(model, block_size, dtype) / 2**20,
    )
    return caches
