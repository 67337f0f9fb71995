"""A whole model on the Triton kernels gives the torch path's greedy tokens.

On CPU the kernels run under Triton's interpreter (fp32, tiny models, few tokens: it is slow);
on a GPU the same test runs natively.
"""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 11, 13, 17]}, {"prompt_token_ids": [7]}, {"prompt_token_ids": [21, 4, 8]}]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_triton_kernels_match_torch_tokens(make_checkpoint, device, arch):
    folder = make_checkpoint(arch, 2)
    engine = dict(max_model_len=64, block_size=4, kv_cache_blocks=32, device=str(device), dtype="float32")
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(folder), kernels="torch", **engine).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    triton_llm = LLM(str(folder), kernels="triton", **engine)
    assert triton_llm.engine.executor.model.ops.name == "triton"
    got = [o.outputs[0].token_ids for o in triton_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected
