"""DeepSeek-V4 against transformers: greedy tokens of a checkpoint transformers writes, mixing a
window-only layer, two CSA layers (4 tokens per entry, top 3 entries per query) and an HCA layer
(16 per entry), hash-routed and learned MoE layers, a window of 8. Prompts of 40 and 200 tokens
run together, their prompts in chunks of 16 and then one decode per step, each layer's cache
allocated from its specs and each sequence holding one block table per group."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model

from moeserve.cache_spec import PagedSpec
from moeserve.models import load_model
from moeserve.models.v4.cache import SequenceView, allocate
from moeserve.models.v4.model import V4Batch, cache_specs

PROMPT_LENGTHS = (40, 200)
NEW_TOKENS, CHUNK, BLOCK = 32, 16, 4


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("deepseek_v4")


def _tables(specs, max_len: int, num_seqs: int) -> tuple[int, list[dict]]:
    """Each sequence's block ids per group, side by side: (blocks per group, tables per sequence)."""
    keys = sorted({s.group_key for layer in specs for s in layer.layers if isinstance(s, PagedSpec)}, key=str)
    per_seq = -(-max_len // BLOCK)  # enough for the densest group (one entry per position)
    tables = [{key: torch.arange(i * per_seq, (i + 1) * per_seq) for key in keys} for i in range(num_seqs)]
    return per_seq * num_seqs, tables


def test_greedy_tokens_match_transformers_in_chunks(checkpoint):
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    reference = hf_model(checkpoint)
    want = [hf_greedy_tokens(reference, p, NEW_TOKENS) for p in prompts]

    model = load_model(checkpoint)
    specs = cache_specs(model.cfg, torch.float32)
    num_blocks, tables = _tables(specs, max(PROMPT_LENGTHS) + NEW_TOKENS, len(prompts))
    caches = [allocate(layer.layers, num_blocks, BLOCK, len(prompts)) for layer in specs]
    sequences = [list(p) for p in prompts]
    done = [0] * len(prompts)  # positions already in the cache
    got: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        while running := [i for i, out in enumerate(got) if len(out) < NEW_TOKENS]:
            step = [min(CHUNK, len(sequences[i]) - done[i]) for i in running]
            views = tuple(SequenceView(done[i], tables[i], i, BLOCK) for i in running)
            ids = torch.tensor([t for i, n in zip(running, step) for t in sequences[i][done[i] : done[i] + n]])
            hidden = model(ids, V4Batch(tuple(step), views), caches)
            tokens = model.compute_logits(hidden[torch.tensor(step).cumsum(0) - 1]).argmax(-1).tolist()
            for i, n, token in zip(running, step, tokens):
                done[i] += n
                if done[i] == len(sequences[i]):
                    got[i].append(token)
                    sequences[i].append(token)
    assert got == want
