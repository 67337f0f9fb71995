"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's MLA
and MoE with DeepSeek Sparse Attention (`DSAConfig`, `layers/dsa.py`).

Both rotate MLA's rope key in interleaved pairs whatever `rope_interleave` says (transformers'
attention always does). Their indexers differ in the rotary layout only: DeepSeek-V3.2 splits
the rotated dims in halves, GLM-5 interleaves them. GLM-5 runs the indexer on some layers only
(`indexer_types`, or the `index_topk_freq` / `index_skip_topk_offset` schedule it derives from,
or an `index_topk_pattern` of F and S); the others attend with the last indexer layer's top-k.
Which layers have an MoE block: `mlp_layer_types` when config.json has it (transformers 5
writes it), else `first_k_dense_replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moeserve.config import DSAConfig, ModelConfig
from moeserve.models.architectures import deepseek
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig
from moeserve.models.checkpoint import CheckpointError

GLM5 = "GlmMoeDsaForCausalLM"


def _indexer_layers(c: HFConfig, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it runs its own indexer: every layer for DeepSeek-V3.2; GLM-5's schedule
    as transformers' `GlmMoeDsaConfig` derives it (offset 2 and frequency 1 by default)."""
    if c.architecture != GLM5:
        return (True,) * num_layers
    types = c.raw.get("indexer_types")
    if types is None and c.raw.get("index_topk_pattern") is not None:
        pattern = c.raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(c.get("index_topk_freq", 1), 1)
        offset = c.get("index_skip_topk_offset", 2)
        return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {"full", "shared"}:
        raise CheckpointError(f"indexer_types must be {num_layers} of 'full' / 'shared', got {types!r}")
    return tuple(t == "full" for t in types)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    base = deepseek.parse_config(raw)
    assert base.mla is not None
    if base.mla.q_lora_rank is None:
        raise CheckpointError(f"{c.architecture} needs q_lora_rank: its indexer reads the query latent")
    mlp_types = raw.get("mlp_layer_types")
    moe_layers = base.moe_layers if mlp_types is None else tuple(t == "sparse" for t in mlp_types)
    dsa = DSAConfig(
        index_n_heads=c.require("index_n_heads"),
        index_head_dim=c.require("index_head_dim"),
        index_topk=c.require("index_topk"),
        interleaved_rope=c.architecture == GLM5,
        indexer_layers=_indexer_layers(c, base.num_layers),
    )
    if dsa.index_head_dim < base.mla.qk_rope_head_dim:
        raise CheckpointError(f"index_head_dim {dsa.index_head_dim} is below qk_rope_head_dim, which it rotates")
    return dataclasses.replace(
        base, dsa=dsa, moe_layers=moe_layers, rope=dataclasses.replace(base.rope, interleaved=True)
    )


ARCHITECTURE = Architecture(
    hf_names=("DeepseekV32ForCausalLM", GLM5),
    parse_config=parse_config,
    names=CheckpointNames(shared_expert="shared_experts"),
)
