"""DeepSeek-V4 against transformers: greedy tokens of a checkpoint transformers writes, mixing a
window-only layer, two CSA layers (4 tokens per entry, top 3 entries per query) and an HCA layer
(16 per entry), hash-routed and learned MoE layers, a window of 8. Prompts of 40 and 200 tokens
run together, their prompts in chunks of 16 and then one decode per step, each layer's cache
allocated from its specs and each sequence holding one block table per group (`GroupedBlocks`):
the window group's pool is too small to hold a sequence's whole context, so the run passes only
if blocks behind the window go back, and every block is free again at the end."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model

from moeserve import LLM
from moeserve.models import load_model
from moeserve.models.decoder import cache_specs as model_cache_specs
from moeserve.models.v4.cache import SequenceView, allocate
from moeserve.models.v4.model import V4Batch, cache_specs
from moeserve.scheduler.block_groups import GroupedBlocks

PROMPT_LENGTHS = (40, 200)
NEW_TOKENS, CHUNK, BLOCK = 32, 16, 4


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("deepseek_v4")


def test_greedy_tokens_match_transformers_in_chunks(checkpoint):
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    reference = hf_model(checkpoint)
    want = [hf_greedy_tokens(reference, p, NEW_TOKENS) for p in prompts]

    model = load_model(checkpoint)
    groups = model_cache_specs(model.cfg, torch.float32).groups
    assert groups == ((1, 8), (4, None), (16, None))
    dense = len(prompts) * -(-(max(PROMPT_LENGTHS) + NEW_TOKENS) // BLOCK)
    window_pool = len(prompts) * (-(-(8 + CHUNK) // BLOCK) + 1)  # a window and a chunk, per sequence
    blocks = GroupedBlocks(groups, [window_pool, dense, dense], BLOCK)
    caches = [allocate(layer.layers, dense, BLOCK, len(prompts)) for layer in cache_specs(model.cfg, torch.float32)]
    sequences = [list(p) for p in prompts]
    done = [0] * len(prompts)  # positions already in the cache
    got: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        while running := [i for i, out in enumerate(got) if len(out) < NEW_TOKENS]:
            step = [min(CHUNK, len(sequences[i]) - done[i]) for i in running]
            assert all(blocks.allocate(str(i), done[i], n) for i, n in zip(running, step))
            views = tuple(
                SequenceView(done[i], {k: torch.tensor(t) for k, t in blocks.tables(str(i)).items()}, i, BLOCK)
                for i in running
            )
            ids = torch.tensor([t for i, n in zip(running, step) for t in sequences[i][done[i] : done[i] + n]])
            hidden = model(ids, V4Batch(tuple(step), views), caches)
            tokens = model.compute_logits(hidden[torch.tensor(step).cumsum(0) - 1]).argmax(-1).tolist()
            for i, n, token in zip(running, step, tokens):
                done[i] += n
                if done[i] == len(sequences[i]):
                    got[i].append(token)
                    sequences[i].append(token)
    assert got == want
    for i in range(len(prompts)):
        blocks.free(str(i))
    assert [blocks.num_free(k) for k in groups] == [window_pool, dense, dense]  # no block leaked


def test_engine_refuses_several_block_table_groups(checkpoint):
    with pytest.raises(ValueError, match="3 block-table groups"):
        LLM(checkpoint)
