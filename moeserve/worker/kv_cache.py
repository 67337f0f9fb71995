"""Allocation of the cache from the layers' specs (`cache_spec`): a paged tensor per attention
layer (a DSA layer: a tuple, its latent and its indexer keys), sized in blocks, and a state per
Gated DeltaNet layer, one slot per running sequence.

Sizing needs only the model's config and the rank's tensor-parallel place, so the process that
schedules (and holds no weights when the model runs in worker processes) can size every data-
parallel group's cache, and each worker allocates exactly what its scheduler planned. The
states come off the budget first (`max_num_seqs` slots, as SGLang sizes its Mamba pool by its
running requests): they are what every running sequence needs whatever its length; the blocks
take the rest. Prefix caching's saved states (`saved_states`, for a model with state layers) are
set aside with them: a hit on such a model resumes only from one.
"""

from __future__ import annotations

import logging

import torch

from moeserve.cache_spec import CacheSpecs, PagedSpec
from moeserve.config import DTYPES, CacheConfig, ModelConfig
from moeserve.models.decoder import cache_specs
from moeserve.models.v4.cache import LayerCache as V4LayerCache
from moeserve.models.v4.cache import allocate as allocate_v4_layer
from moeserve.models.v4.cache import kept_bytes_per_sequence
from moeserve.ops.state_batch import LinearState
from moeserve.scheduler.block_groups import group_block_counts

logger = logging.getLogger(__name__)


def bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1, mtp_layers: int = 0
) -> int:
    """Paged bytes one block costs on one rank, all paged layers together (`mtp_layers`: the MTP
    layers loaded to draft, whose KV shares the blocks)."""
    return cache_specs(cfg, dtype, tp_size, mtp_layers).bytes_per_block(block_size)


def state_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    num_slots: int,
    tp_size: int = 1,
    draft_states: int = 0,
    saved_states: int = 0,
) -> int:
    """Bytes of `num_slots` sequences' states on one rank, with the `draft_states` each keeps to step
    back past rejected drafts (DeepSeek-V4: its verify step's inputs instead, about one state),
    and prefix caching's `saved_states` (0 for a model without state layers)."""
    specs = cache_specs(cfg, dtype, tp_size)
    if cfg.compressed_attention is not None:
        drafts = kept_bytes_per_sequence(specs, draft_states)
    else:
        drafts = draft_states * specs.state_bytes_per_sequence
    return (num_slots + saved_states) * specs.state_bytes_per_sequence + num_slots * drafts


def num_blocks_for(
    cfg: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int,
    tp_size: int = 1,
    mtp_layers: int = 0,
    draft_states: int = 0,
    saved_states: int = 0,
    max_num_batched_tokens: int = 0,
) -> int:
    """Blocks that fit the per-rank memory budget once `max_num_seqs` states (and their
    `draft_states`) and prefix caching's `saved_states` are set aside, but no more than every
    sequence slot at full length can ever use. A model with several block-table groups: blocks
    of context (`context_blocks`), the window groups sized for a step of `max_num_batched_tokens`."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    states = state_bytes(cfg, dtype, max_num_seqs, tp_size, draft_states, saved_states)
    budget = cache.memory_bytes - states
    if budget <= 0:
        raise ValueError(
            f"the KV cache budget ({cache.memory_bytes / 2**20:.1f} MiB) does not hold the states of "
            f"{max_num_seqs} sequences and {saved_states} saved ones ({states / 2**20:.1f} MiB): raise "
            "the budget or lower max_num_seqs or saved_states"
        )
    most = -(-max_num_seqs * max_model_len // cache.block_size)
    specs = cache_specs(cfg, dtype, tp_size, mtp_layers)
    if len(specs.groups) > 1:
        return context_blocks(specs, budget, cache.block_size, max_num_seqs, max_num_batched_tokens, most)
    fitting = budget // specs.bytes_per_block(cache.block_size)
    return max(1, min(fitting, most))


def context_blocks(
    specs: CacheSpecs, budget: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, most: int
) -> int:
    """The context, in blocks of positions, that `budget` bytes hold for a model with several
    groups (at most `most`): the window groups' pools come first (what the running sequences'
    windows read, whatever the context), the rest buys compressed entries, each group's blocks
    in proportion to its bytes per position of context (`group_block_counts`)."""
    sizes = specs.group_bytes_per_block(block_size)
    pools = group_block_counts(specs.groups, most, block_size, max_num_seqs, max_num_batched_tokens)
    fixed = sum(
        (n if window is not None else max_num_seqs + 1) * size
        for (_, window), n, size in zip(specs.groups, pools, sizes, strict=True)
    )
    per_block = sum(size / ratio for (ratio, window), size in zip(specs.groups, sizes) if window is None)
    if budget <= fixed:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB once states are set aside) does not hold the "
            f"sliding windows of {max_num_seqs} sequences ({fixed / 2**20:.1f} MiB): raise it or lower max_num_seqs"
        )
    return max(1, min(most, int((budget - fixed) // per_block) if per_block else most))


def allocate_kv_caches(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
    mtp_layers: int = 0,
    num_state_slots: int = 0,
    draft_states: int = 0,
    num_saved_states: int = 0,
    max_num_batched_tokens: int = 0,
) -> list[torch.Tensor | tuple[torch.Tensor, ...] | LinearState] | list[V4LayerCache]:
    """Zeroed, so a bug that reads an unwritten slot shows up as a wrong token, not as NaN noise.
    The decoder layers' caches, then `mtp_layers` more for the MTP layers loaded to draft; a state
    layer's holds `num_state_slots` sequences, each with `draft_states` more to verify drafts, and
    `num_saved_states` saved ones for prefix caching. A model with several block-table groups
    (DeepSeek-V4): `num_blocks` blocks of context, each group's pool from `group_block_counts`."""
    specs = cache_specs(cfg, dtype, tp_size, mtp_layers)
    if len(specs.groups) > 1:
        counts = group_block_counts(specs.groups, num_blocks, block_size, num_state_slots, max_num_batched_tokens)
        pools = dict(zip(specs.groups, counts, strict=True))
        logger.info(
            "KV cache: %d blocks of %d tokens of context; block-table groups (tokens per entry, window): %s",
            num_blocks,
            block_size,
            ", ".join(f"{key}: {n} blocks" for key, n in pools.items()),
        )
        return [
            allocate_v4_layer(spec, pools, block_size, num_state_slots, device, num_saved_states, draft_states)
            for spec in specs.layers
        ]
    caches: list[torch.Tensor | tuple[torch.Tensor, ...] | LinearState] = []

    def paged(spec: PagedSpec) -> torch.Tensor:
        """In the spec's own dtype: FP8 indexer keys are uint8 rows beside a latent in `dtype`."""
        return torch.zeros(spec.shape(num_blocks, block_size), dtype=getattr(torch, spec.dtype), device=device)

    for spec in specs.layers:
        if isinstance(spec, PagedSpec):
            caches.append(paged(spec))
        elif isinstance(spec, tuple):
            caches.append(tuple(paged(s) for s in spec))
        else:
            parts = list(zip(spec.shapes, spec.dtypes, strict=True))
            conv, recurrent = (
                torch.zeros((num_state_slots, *shape), dtype=DTYPES[n], device=device) for shape, n in parts
            )
            drafts = saved = [None, None]
            if draft_states:
                drafts = [
                    torch.zeros((num_state_slots, draft_states, *shape), dtype=DTYPES[n], device=device)
                    for shape, n in parts
                ]
            if num_saved_states:
                saved = [torch.zeros((num_saved_states, *shape), dtype=DTYPES[n], device=device) for shape, n in parts]
            caches.append(LinearState(conv, recurrent, *drafts, *saved))
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %.1f MiB%s",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * specs.bytes_per_block(block_size) / 2**20,
        f"; states: {num_state_slots} slots and {num_saved_states} saved, "
        f"{(num_state_slots * (1 + draft_states) + num_saved_states) * specs.state_bytes_per_sequence / 2**20:.1f} MiB"
        if specs.has_state
        else "",
    )
    return caches
