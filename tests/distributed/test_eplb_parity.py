"""Redundant experts and any expert placement give the single process's greedy tokens.

The router picks logical experts; each (token, k) pair is sent to one physical replica of its
expert, so every backend moves rows between physical slots only. Which replica serves a pair
does not change its result, and combine sums each token's rows in logical order, so the tokens
equal ep=1's without replicas whatever the map: here a shuffled map with replicas at ep=2 over
the `nvshmem` backend (Triton peer stores, interpreted on CPU). The `local` backend with replicas
is checked bit for bit in tests/unit/test_expert_map.py, and the `torch` one at ep=4 across live
rebalances in test_eplb_live.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.dispatch import ExpertMap

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=64)
NUM_EXPERTS, NUM_LAYERS = 8, 2


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in (1, 19, 6, 33, 4)]


def shuffled_map(ep: int, num_redundant: int, seed: int) -> ExpertMap:
    """Every expert once plus `num_redundant` random replicas, in a random slot order per layer."""
    rng = random.Random(seed)
    layers = []
    for _ in range(NUM_LAYERS):
        slots = list(range(NUM_EXPERTS)) + [rng.randrange(NUM_EXPERTS) for _ in range(num_redundant)]
        rng.shuffle(slots)
        layers.append(tuple(slots))
    return ExpertMap(tuple(layers), NUM_EXPERTS, ep)


@pytest.fixture(scope="module")
def model(make_checkpoint):
    """(checkpoint, ep=1 tokens without replicas)."""
    folder = make_checkpoint("qwen3_moe", 7, num_experts=NUM_EXPERTS, num_experts_per_tok=3)
    with LLM(str(folder), **ENGINE) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    return folder, expected


@pytest.mark.parametrize("ep,num_redundant,backend", [(2, 4, "nvshmem")])
def test_replicas_match_single_process(model, tmp_path, ep, num_redundant, backend):
    folder, expected = model
    path = tmp_path / "placement.json"
    shuffled_map(ep, num_redundant, seed=ep).save(path)
    options = dict(ENGINE, ep=ep, num_redundant_experts=num_redundant, expert_placement=str(path), a2a_backend=backend)
    with LLM(str(folder), **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected
