"""A whole model on the Triton kernels gives the torch path's greedy tokens.

On CPU the kernels run under Triton's interpreter (fp32, tiny models, few tokens: it is slow);
on a GPU the same test runs natively.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 11, 13, 17]}, {"prompt_token_ids": [7]}, {"prompt_token_ids": [21, 4, 8]}]


CASES = [
    ("qwen3_moe", {}),
    ("mixtral", {}),
    ("deepseek_v3", {}),
    # DeepSeek Sparse Attention (GLM-5: an indexer layer, then one reusing its top-k) with the
    # indexer keeping the top 4 of up to 9 tokens: sparse steps (the indexer and gather-attend
    # kernels) and dense ones (no context past the top-k).
    ("glm_moe_dsa", {"index_topk": 4, "num_hidden_layers": 2}),
]


@pytest.mark.parametrize("arch,overrides", CASES, ids=[arch for arch, _ in CASES])
def test_triton_kernels_match_torch_tokens(make_checkpoint, device, arch, overrides):
    folder = make_checkpoint(arch, 2, **overrides)
    engine = dict(max_model_len=64, block_size=4, kv_cache_blocks=32, device=str(device), dtype="float32")
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(folder), kernels="torch", **engine).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    triton_llm = LLM(str(folder), kernels="triton", **engine)
    assert triton_llm.engine.executor.model.ops.name == "triton"
    got = [o.outputs[0].token_ids for o in triton_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected


def test_deepseek_v4_on_the_kernels_gives_the_torch_tokens(make_checkpoint, device):
    """The tiny V4 checkpoint (a window of 8, CSA layers keeping 3 of up to 6 entries, an HCA
    layer; hash-routed then learned MoE layers, the clamp at 1 biting) served whole on the
    kernels: attention and indexer choice, the sqrtsoftplus router and the clamped-SiLU fused MoE.
    A 20-token prompt in chunks of 16 (the second chunk's queries see 4 entries and choose 3)
    then 2 greedy tokens gives the torch path's tokens. (The interpreter is slow: the engine-level
    runs of the V4 parity tests stay on torch.)"""
    folder = make_checkpoint("deepseek_v4")
    prompt = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(44)).tolist()
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine = dict(
        max_model_len=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=16, device=str(device), dtype="float32"
    )
    tokens = {}
    for kernels in ("torch", "triton"):
        with LLM(str(folder), kernels=kernels, **engine) as llm:
            assert llm.engine.executor.model.ops.name == kernels
            tokens[kernels] = (
                llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
            )
    assert tokens["triton"] == tokens["torch"]


def _prefill_logits(folder, dtype, kernels: str, prompts: list[list[int]]):
    """One paged prefill of every prompt on the GPU; float32 logits of every position."""
    import torch

    from moeserve.models import load_model
    from moeserve.ops import attention_batch, create_ops

    model = load_model(folder, dtype, "cuda", ops=create_ops(kernels, "cuda"))
    block_size, tables, start = 4, [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(start, start + n)))
        start += n
    caches = [torch.zeros(model.kv_cache_shape(start, block_size), dtype=dtype, device="cuda") for _ in model.layers]
    plan = model.ops.plan_attention(
        attention_batch(tables, [0] * len(prompts), [len(p) for p in prompts], block_size, "cuda")
    )
    ids = torch.tensor(sum(prompts, []), device="cuda")
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).cuda()
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, plan, caches)).float()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_gpu_bf16_whole_model_as_close_as_torch(make_checkpoint, arch):
    """In bf16 neither backend equals fp32; the Triton kernels must land as close to it as torch's."""
    import torch

    folder = make_checkpoint(arch, 2)
    prompts = [p["prompt_token_ids"] for p in PROMPTS] + [list(range(10, 50))]
    exact = _prefill_logits(folder, torch.float32, "torch", prompts)

    def rel_err(kernels: str) -> float:
        return ((_prefill_logits(folder, torch.bfloat16, kernels, prompts) - exact).norm() / exact.norm()).item()

    torch_err, triton_err = rel_err("torch"), rel_err("triton")
    assert torch_err < 0.1, torch_err  # ~6e-2 on CPU: bf16 through two random layers
    assert triton_err <= 1.5 * torch_err + 1e-3, (triton_err, torch_err)
