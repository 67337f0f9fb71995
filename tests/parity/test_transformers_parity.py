"""moeserve against transformers' own implementation: prefill logits and greedy generation.

Each case is a checkpoint written by transformers (random weights) and loaded by both sides.
Cases cover every architecture, top-k from 1 to 4, odd expert counts (6, 7), GQA ratios 1 and 4,
head_dim 16 and 32, YaRN rope, partial rotary, sliding windows, attention sinks, tied embeddings,
and prompts of 1 to 40 tokens in one batch.
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model

from moeserve import LLM, SamplingParams
from moeserve.models import load_model
from moeserve.ops import attention_batch

CASES = [
    ("mixtral", 0, dict(num_local_experts=6, num_experts_per_tok=2)),
    ("mixtral", 1, dict(num_local_experts=7, num_experts_per_tok=1, num_key_value_heads=4, head_dim=32)),
    (
        "mixtral",
        2,
        dict(num_local_experts=6, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    ),
    ("qwen2_moe", 0, dict(num_experts=7, num_experts_per_tok=3)),
    (
        "qwen2_moe",
        1,
        dict(num_experts=6, num_experts_per_tok=1, norm_topk_prob=True, num_key_value_heads=4, head_dim=32),
    ),
    ("qwen3_moe", 0, dict(num_experts=6, num_experts_per_tok=2)),
    (
        "qwen3_moe",
        1,
        dict(
            num_experts=7,
            num_experts_per_tok=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            norm_topk_prob=False,
        ),
    ),
    ("qwen3_moe", 2, dict(num_experts=6, num_experts_per_tok=3, num_key_value_heads=4, mlp_only_layers=[0])),
    ("deepseek_v3", 0, dict()),
    (
        "deepseek_v3",
        1,
        dict(
            n_routed_experts=6, n_group=2, topk_group=1, num_experts_per_tok=2, q_lora_rank=None, norm_topk_prob=False
        ),
    ),
    (
        "deepseek_v3",
        2,
        dict(
            n_routed_experts=8,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=4,
            num_hidden_layers=3,
            first_k_dense_replace=0,
        ),
    ),
    ("deepseek_v2", 0, dict()),
    ("deepseek_v2", 1, dict(topk_method="greedy", q_lora_rank=None, n_routed_experts=7, num_experts_per_tok=2)),
    # Long-context variants: DeepSeek-V3's YaRN rope with mscale, Mixtral's sliding window,
    # and tied embeddings.
    (
        "deepseek_v3",
        3,
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                original_max_position_embeddings=32,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            )
        ),
    ),
    ("mixtral", 3, dict(sliding_window=12, tie_word_embeddings=True)),
    # Newer families: OLMoE's whole-projection q/k norm (and its clip), GLM-4.5's partial rotary
    # with DeepSeek-V3's router, MiniMax-M2's one-group sigmoid router, gpt-oss's sinks, sliding
    # layers, clamped SwiGLU with expert biases and YaRN.
    ("olmoe", 0, dict(clip_qkv=0.8)),
    ("glm4_moe", 0, dict()),
    ("minimax_m2", 0, dict()),
    ("gpt_oss", 0, dict()),
]
IDS = [f"{arch}-{seed}" for arch, seed, _ in CASES]
PROMPT_LENGTHS = (1, 3, 9, 17, 26, 40)


def prompts_for(seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("arch,seed,overrides", CASES, ids=IDS)
def test_prefill_logits_match(make_checkpoint, arch, seed, overrides):
    folder = make_checkpoint(arch, seed, **overrides)
    ref_model, ours = hf_model(folder), load_model(folder)
    prompts = prompts_for(seed, ours.cfg.vocab_size)
    block_size = 4
    tables, next_block = [], 0
    for p in prompts:  # disjoint, scrambled block tables: paging must not change a thing
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))
        next_block += n
    caches = [torch.zeros(ours.kv_cache_shape(next_block, block_size)) for _ in ours.layers]
    plan = ours.ops.plan_attention(attention_batch(tables, [0] * len(prompts), [len(p) for p in prompts], block_size))
    with torch.inference_mode():
        hidden = ours(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(len(p)) for p in prompts]), plan, caches)
        logits = ours.compute_logits(hidden)
        start = 0
        for p in prompts:
            ref = ref_model(torch.tensor([p])).logits[0]
            got = logits[start : start + len(p)]
            start += len(p)
            assert (got - ref).abs().max().item() < 1e-4, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("arch,seed,overrides", CASES, ids=IDS)
def test_greedy_generation_matches(make_checkpoint, arch, seed, overrides):
    folder = make_checkpoint(arch, seed, **overrides)
    ref_model = hf_model(folder)
    llm = LLM(str(folder), block_size=8, max_model_len=128, max_num_seqs=8)
    prompts = prompts_for(seed, ref_model.config.vocab_size)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    )
    for p, out in zip(prompts, outs):
        ref = hf_greedy_tokens(ref_model, p, 32)
        assert out.outputs[0].token_ids == ref, f"prompt of {len(p)} tokens"
        assert out.outputs[0].finish_reason == "length"


def test_batch_where_some_experts_get_no_tokens(make_checkpoint):
    """Decoding one sequence with top-1 of 7 experts leaves at least 6 experts empty each step."""
    folder = make_checkpoint(
        "mixtral", 1, num_local_experts=7, num_experts_per_tok=1, num_key_value_heads=4, head_dim=32
    )
    llm = LLM(str(folder), block_size=8, max_model_len=64)
    counts: list[tuple[int, ...]] = []
    for layer in llm.engine.executor.model.layers:
        layer.mlp.experts.register_forward_pre_hook(
            lambda mod, args: counts.append(tuple(args[0].num_tokens_per_expert.tolist()))
        )
    ref_model = hf_model(folder)
    prompt = [5, 9, 11]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert any(c.count(0) >= 6 for c in counts), counts
    ref = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out.outputs[0].token_ids == ref[0, 3:].tolist()
