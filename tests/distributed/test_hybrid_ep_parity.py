"""Qwen3.5-MoE and Qwen3-Next over expert and tensor parallelism: transformers' greedy tokens.

`--ep 4`: four rank processes, each its own data-parallel attention group, so each holds the
states of its own sequences; `--ep 4 --tp 2`: two groups of two ranks, each rank holding half of
every DeltaNet's key and value heads (their projection rows, conv channels, A_log and dt_bias)
and of the attention heads, out_proj and o_proj summed over the pair, and a later turn of a
prompt resuming from its saved states (each rank copies its share). 8 experts, 2 per rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CASES = [("qwen3_5_moe", 4, 1), ("qwen3_5_moe", 4, 2), ("qwen3_next", 4, 1), ("qwen3_next", 4, 2)]


@pytest.mark.parametrize("arch,ep,tp", CASES, ids=[f"{a}-ep{e}-tp{t}" for a, e, t in CASES])
def test_layout_matches_transformers(make_checkpoint, arch, ep, tp):
    folder = make_checkpoint(arch, num_experts=8)
    g = torch.Generator().manual_seed(3000)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 120, 200, 63)]
    ref = hf_model(folder)
    counts = CountingStatLogger()
    with LLM(str(folder), ep=ep, tp=tp, max_num_seqs=8, max_num_batched_tokens=64, stat_loggers=[counts]) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        if tp > 1:  # a later turn of the first prompt resumes from its state saved at 32, on every rank
            turn = prompts[0] + list(outputs[0].outputs[0].token_ids) + prompts[3][:5]
            prompts.append(turn)
            outputs += llm.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)
            assert counts.prefix_cache_hits == 32
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy_tokens(ref, prompt, 32)


def test_ngram_drafts_over_tensor_parallel_ranks(make_checkpoint):
    """`--ep 2 --tp 2`: only the group's first rank samples and judges drafts; the other rank steps
    its DeltaNet states back from the next step's start positions alone, to the same tokens."""
    folder = str(make_checkpoint("qwen3_next", num_experts=8))
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 320, (20,), generator=g).tolist()
    prompts = [{"prompt_token_ids": p} for p in (base * 3, torch.randint(3, 320, (45,), generator=g).tolist())]
    plain = [o.outputs[0].token_ids for o in LLM(folder, max_num_seqs=4).generate(prompts, GREEDY, use_tqdm=False)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(folder, ep=2, tp=2, max_num_seqs=4, speculative_config=ngram) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
