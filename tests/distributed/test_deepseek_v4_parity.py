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
from moeserve.models.v4.compressor import Compressor
from moeserve.spec_decode.ngram import NgramProposer
from moeserve.spec_decode.stats import SpecDecodeStats

PROMPT_LENGTHS = (40, 200)
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256, block_size=4)
DRAFTS = 3


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
    usage = llm.engine.scheduler.group_blocks  # what /metrics labels by group: every data-parallel group's
    assert [g.group for g in usage] == ["window", "compressed_4", "compressed_16"] and not any(g.used for g in usage)
    pools = [n for scheduler in llm.engine.scheduler.groups for _, n in scheduler.config.block_groups]
    assert sum(g.total for g in usage) == llm.engine.scheduler.num_kv_blocks == sum(pools)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_match_transformers_in_chunks(checkpoint, prompts_and_tokens):
    prompts, want = prompts_and_tokens
    with LLM(str(checkpoint), enable_prefix_caching=True, **ENGINE) as llm:  # turned off: several groups
        assert not llm.engine.scheduler.groups[0].config.enable_prefix_caching
        assert _generate_without_leaks(llm, prompts) == want


@pytest.mark.parametrize("tp", [1, 2], ids=["ep4", "ep4-tp2"])
def test_expert_parallel_greedy_tokens_match_transformers(checkpoint, prompts_and_tokens, tp):
    """Both prompts spread over the data-parallel groups, each group's MoE over every rank."""
    prompts, want = prompts_and_tokens
    with LLM(str(checkpoint), ep=4, tp=tp, **ENGINE) as llm:
        assert _generate_without_leaks(llm, prompts) == want


def _generate_with_drafts(
    monkeypatch, checkpoint, prompts_and_tokens, **layout
) -> tuple[LLM, list[int], SpecDecodeStats]:
    """The 40-token prompt's greedy tokens with n-gram drafts (3 a step), no block left held, and
    the drafts counted. The proposer drafts transformers' greedy tokens, every fifth one wrong (a
    random model's output seldom repeats itself), so drafts are kept and rejected at every offset
    in the compressors' windows (4 and 16 tokens)."""
    (prompt, _), (want, _) = prompts_and_tokens

    def oracle(self, num_tokens):
        first = self.num_tokens - len(prompt)  # the output index of the token after the sequence's last
        return [t + (i % 5 == 2) for i, t in enumerate(want[first : first + num_tokens], first)]

    monkeypatch.setattr(NgramProposer, "propose", oracle)
    counts = CountingStatLogger()
    ngram = {"method": "ngram", "num_speculative_tokens": DRAFTS}
    with LLM(str(checkpoint), speculative_config=ngram, stat_loggers=[counts], **layout, **ENGINE) as llm:
        tokens = _generate_without_leaks(llm, [prompt])[0]
    return llm, tokens, counts.spec_decode


def test_drafts_step_the_open_windows_back(checkpoint, prompts_and_tokens, monkeypatch):
    """n-gram drafts verified through every cache group: the tokens stay transformers', some
    rejection came after a window closed on a rejected draft (the open window and carry then step
    back to the last kept token, its entry rewritten when the right tokens close it), and neither
    a block nor a state slot is left held."""
    step_back, stepped = Compressor.step_back, []

    def spy(self, start, accepted, *args):
        verified = start - 1 - accepted  # the verify step's first position
        stepped.append(start // self.ratio < (verified + 1 + DRAFTS) // self.ratio)  # the window `start` is in closed
        step_back(self, start, accepted, *args)

    monkeypatch.setattr(Compressor, "step_back", spy)
    llm, tokens, drafted = _generate_with_drafts(monkeypatch, checkpoint, prompts_and_tokens)
    assert tokens == prompts_and_tokens[1][0]
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens and any(stepped)
    assert len(llm.engine.executor.runner.states.request_ids) <= 1  # a slot goes back with the next plan


def test_drafts_over_expert_and_tensor_parallel_ranks(checkpoint, prompts_and_tokens, monkeypatch):
    """`--ep 4 --tp 2`: the group's first rank judges the drafts, every rank steps its open windows
    back from the next step's start positions alone, to transformers' tokens."""
    _, tokens, drafted = _generate_with_drafts(monkeypatch, checkpoint, prompts_and_tokens, ep=4, tp=2)
    assert tokens == prompts_and_tokens[1][0]
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens


def test_features_not_built_for_several_groups_are_refused(checkpoint):
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="MTP drafts are not built for caches in several block-table"):
        LLM(str(checkpoint), speculative_config=mtp)
    with pytest.raises(ValueError, match="two-batch overlap is not built for caches in several block-table"):
        LLM(str(checkpoint), two_batch_overlap=True)
    with pytest.raises(ValueError, match="disaggregation .kv_transfer. is not built for caches in several"):
        LLM(str(checkpoint), role="decode", kv_transfer="nixl")
