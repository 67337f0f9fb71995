"""What one decode token's attention costs a DeepSeek Sparse Attention model at a context length,
against the same model attending densely: FLOPs and cache bytes read, summed over the layers,
from the model's config and its cache specs (`models.decoder.cache_specs`), not from a model.

Dense MLA (absorbed, as the kernels run it): per head and context token, a score over the
latent and rope key (`2 (rank + rope)` FLOPs) and a value over the latent (`2 rank`); the whole
latent cache is read. DSA: the indexer scores every context token (`2 Di` FLOPs per indexer head,
plus the weighted sum) reading every indexer key, and MLA then runs over `min(context, top-k)`
tokens, reading only their latents. GLM-5's layers without an indexer skip its part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.cache_spec import PagedSpec
from moeserve.config import ModelConfig
from moeserve.models.decoder import cache_specs
from moeserve.plan.shapes import indexer_flops_per_key


@dataclass(frozen=True)
class DecodeAttentionCost:
    flops: float
    bytes: float


def decode_attention_cost(
    cfg: ModelConfig, context: int, sparse: bool = True, dtype: torch.dtype = torch.bfloat16
) -> DecodeAttentionCost:
    """One decode token at `context` tokens, all decoder layers on one rank (`--tp 1`); `sparse`
    False: the same model attending to its whole context (dense MLA, no indexer)."""
    assert cfg.mla is not None and cfg.dsa is not None
    m, d = cfg.mla, cfg.dsa
    per_token_flops = cfg.num_heads * (2 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank)
    flops = nbytes = 0.0
    for layer, spec in enumerate(cache_specs(cfg, dtype).layers):
        latent, keys = (spec[0], spec[1]) if isinstance(spec, tuple) else (spec, None)
        assert isinstance(latent, PagedSpec)
        attended = min(context, d.index_topk) if sparse else context
        flops += attended * per_token_flops
        nbytes += attended * latent.bytes_per_token
        if sparse and keys is not None and d.has_indexer(layer):
            flops += context * indexer_flops_per_key(d.index_n_heads, d.index_head_dim)
            nbytes += context * keys.bytes_per_token
    return DecodeAttentionCost(flops, nbytes)
