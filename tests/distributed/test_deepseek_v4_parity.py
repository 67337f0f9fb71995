"""DeepSeek-V4 against transformers: greedy tokens of a checkpoint transformers writes, mixing a
window-only layer, two CSA layers (4 tokens per entry, top 3 entries per query) and an HCA layer
(16 per entry), hash-routed and learned MoE layers, a window of 8. Prompts of 40 and 200 tokens,
prefilled in chunks of 16 then decoded (`helpers.v4_greedy`, which also checks that window blocks
go back and no block leaks): both together on one rank, then over `--ep 4` (and `--tp 2`) with
the `torch` all-to-all dispatcher (hash routing through the same dispatch and combine)."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_cases import rank_greedy
from helpers.reference import hf_greedy_tokens, hf_model
from helpers.v4_greedy import NEW_TOKENS, greedy_in_chunks, steps_for
from ranks import run_ranks

from moeserve import LLM
from moeserve.models import load_model

PROMPT_LENGTHS = (40, 200)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("deepseek_v4")


@pytest.fixture(scope="module")
def prompts_and_tokens(checkpoint):
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    reference = hf_model(checkpoint)
    return prompts, [hf_greedy_tokens(reference, p, NEW_TOKENS) for p in prompts]


def test_greedy_tokens_match_transformers_in_chunks(checkpoint, prompts_and_tokens):
    prompts, want = prompts_and_tokens
    got, no_leak = greedy_in_chunks(load_model(checkpoint), prompts, steps_for(PROMPT_LENGTHS))
    assert got == want
    assert no_leak


@pytest.mark.parametrize("tp", [1, 2], ids=["ep4", "ep4-tp2"])
def test_expert_parallel_greedy_tokens_match_transformers(checkpoint, prompts_and_tokens, tp):
    """`--ep 4`: a prompt per rank; `--ep 4 --tp 2`: a prompt per pair of ranks, each rank's MoE
    on half its pair's tokens."""
    prompts, want = prompts_and_tokens
    per_group = [prompts[1], prompts[0], prompts[0], prompts[0]][: 4 // tp]
    results = run_ranks(4, rank_greedy, str(checkpoint), per_group, steps_for(PROMPT_LENGTHS), tp, timeout=600)
    expected = [want[1], want[0], want[0], want[0]][: 4 // tp]
    assert [tokens for tokens, _ in results] == [t for t in expected for _ in range(tp)]
    assert all(no_leak for _, no_leak in results)


def test_engine_refuses_several_block_table_groups(checkpoint):
    with pytest.raises(ValueError, match="3 block-table groups"):
        LLM(checkpoint)
