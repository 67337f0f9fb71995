"""DeepSeek-V4 served by the engine against transformers: greedy tokens of a checkpoint
transformers writes, mixing a window-only layer, two CSA layers (4 tokens per entry, top 3
entries per query) and an HCA layer (16 per entry), hash-routed and learned MoE layers, a window
of 8. Prompts of 40 and 200 tokens, prefilled in chunks of 16 then decoded, each request's block
tables per group handed out by the scheduler (`block_groups`), the window group's pool too small
for the prompts unless blocks behind the window go back; no block is held at the end. On one
rank, then over `--ep 4` (and `--tp 2`, attention replicated on each pair of ranks)."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

PROMPT_LENGTHS = (40, 200)
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256, block_size=4)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("deepseek_v4")


@pytest.fixture(scope="module")
def prompts_and_tokens(checkpoint):
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    reference = hf_model(checkpoint)
    return prompts, [hf_greedy_tokens(reference, p, NEW_TOKENS) for p in prompts]


def _generate_without_leaks(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens; every group's pool whole again afterwards, each window pool too small for
    the longest sequence had nothing gone back."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    longest = max(map(len, prompts)) + NEW_TOKENS
    for scheduler in llm.engine.scheduler.groups:
        window_pools = [n for (_, window), n in scheduler.config.block_groups if window is not None]
        assert window_pools and all(n * ENGINE["block_size"] < longest for n in window_pools)
        assert scheduler.block_manager.num_used_blocks == 0
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_match_transformers_in_chunks_and_from_the_prefix_cache(checkpoint, prompts_and_tokens):
    """The 40-token prompt beside a first request holding the 200-token prompt's first 150 tokens,
    then the 200-token prompt: a hit resumes only at a block boundary of every group (block 4 x 16
    positions per entry: every 64 positions) where the open windows' states were saved (the first
    request's prompt mark), so it resumes at 128 from that request's entries, the window blocks it
    gave back as its window moved, and its saved states."""
    prompts, want = prompts_and_tokens
    counts = CountingStatLogger()
    with LLM(str(checkpoint), enable_prefix_caching=True, stat_loggers=[counts], **ENGINE) as llm:
        assert _generate_without_leaks(llm, [prompts[0], prompts[1][:150]])[0] == want[0]
        assert counts.prefix_cache_hits == 0
        assert _generate_without_leaks(llm, [prompts[1]]) == [want[1]]
        assert counts.prefix_cache_hits == 128
        states, saved = llm.engine.executor.runner.states, llm.engine.scheduler.groups[0].block_manager.saved_states
        assert states.num_free >= states.num_slots - 1  # the last to finish gives its slot back at the next plan
        assert saved.num_pending == 0 and saved.num_held > 0


@pytest.mark.parametrize("tp", [1, 2], ids=["ep4", "ep4-tp2"])
def test_expert_parallel_greedy_tokens_match_transformers(checkpoint, prompts_and_tokens, tp):
    """Both prompts spread over the data-parallel groups, each group's MoE over every rank."""
    prompts, want = prompts_and_tokens
    with LLM(str(checkpoint), ep=4, tp=tp, **ENGINE) as llm:
        assert _generate_without_leaks(llm, prompts) == want


def test_features_not_built_for_several_groups_are_refused(checkpoint):
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative decoding is not built for caches in several block-table"):
        LLM(str(checkpoint), speculative_config=ngram)
    with pytest.raises(ValueError, match="two-batch overlap is not built for caches in several block-table"):
        LLM(str(checkpoint), two_batch_overlap=True)
    with pytest.raises(ValueError, match="disaggregation .kv_transfer. is not built for caches in several"):
        LLM(str(checkpoint), role="decode", kv_transfer="nixl")
