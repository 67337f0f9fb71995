"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) over expert and tensor parallelism:
transformers' greedy tokens.

`--ep 4`: four rank processes, each its own data-parallel attention group with its own latent and
indexer-key caches; `--ep 4 --tp 2`: two groups of two ranks, each rank holding half of the MLA
heads and the whole indexer (replicated, as the latent projections are), so both ranks of a
group choose the same positions. Chunks of 16 tokens; the indexer keeps the top 16.
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CASES = [("deepseek_v32", 4, 1), ("deepseek_v32", 4, 2), ("glm_moe_dsa", 4, 1), ("glm_moe_dsa", 4, 2)]


PROMPT_LENGTHS = (40, 120, 200, 63)


@pytest.fixture(scope="module")
def expected(make_checkpoint):
    """Per architecture: its checkpoint, the prompts and transformers' tokens (computed once)."""
    found = {}

    def of(arch: str):
        if arch not in found:
            folder = make_checkpoint(arch)
            g = torch.Generator().manual_seed(3100)
            prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
            ref = hf_model(folder)
            found[arch] = folder, prompts, [hf_greedy_tokens(ref, p, 32) for p in prompts]
        return found[arch]

    return of


@pytest.mark.parametrize("arch,ep,tp", CASES, ids=[f"{a}-ep{e}-tp{t}" for a, e, t in CASES])
def test_layout_matches_transformers(expected, arch, ep, tp):
    folder, prompts, tokens = expected(arch)
    with LLM(str(folder), ep=ep, tp=tp, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == tokens
