"""Tiny transformers configs of every architecture, with HF's own field names: what the
`make_checkpoint` fixture builds, and what config-parser tests read without building weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

VOCAB = 320  # 256 byte symbols + specials + a few merges: the smallest useful byte-level BPE


def hf_config(arch: str, **overrides: Any):
    """A transformers config for a tiny model of `arch`; overrides use HF's own field names."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        DeepseekV4Config,
        DeepseekV32Config,
        Glm4MoeConfig,
        GlmMoeDsaConfig,
        GptOssConfig,
        MiniMaxM2Config,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3_5MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        cfg = dict(common, num_local_experts=6, num_experts_per_tok=2, head_dim=16)
        cls = MixtralConfig
    elif arch == "qwen2_moe":
        cfg = dict(
            common,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=7,
            num_experts_per_tok=3,
            head_dim=16,
        )
        cls = Qwen2MoeConfig
    elif arch == "qwen3_moe":
        cfg = dict(
            common, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True
        )
        cls = Qwen3MoeConfig
    elif arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        cfg = dict(
            common,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        )
        cls = DeepseekV3Config
        if arch != "deepseek_v3":  # DeepSeek Sparse Attention: the top 16 of contexts up to 232 tokens
            # 16 indexer heads: no two keys tie at a score of exactly 0 (every head's ReLU zero)
            cfg.update(num_hidden_layers=3, index_topk=16, index_n_heads=16, index_head_dim=16)
            cls = DeepseekV32Config
        if arch == "glm_moe_dsa":  # layers 0 and 2 run the indexer, layer 1 reuses layer 0's top-k
            cfg.update(index_topk_freq=2, index_skip_topk_offset=1)
            cls = GlmMoeDsaConfig
    elif arch == "deepseek_v2":
        cfg = dict(
            common,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
        )
        cls = DeepseekV2Config
    elif arch == "olmoe":  # q/k norm over the whole projection; head_dim = hidden / heads
        cfg = dict(common, intermediate_size=32, num_experts=6, num_experts_per_tok=2)
        cls = OlmoeConfig
    elif arch == "glm4_moe":
        cfg = dict(
            common,
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        )
        cls = Glm4MoeConfig
    elif arch == "minimax_m2":  # the released config's legacy rotary_dim: a quarter of each head rotates
        cfg = dict(common, head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, rotary_dim=4)
        cls = MiniMaxM2Config
    elif arch == "gpt_oss":
        cfg = dict(
            common,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,  # low enough that the tiny model's gate and up values get clamped
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        )
        cls = GptOssConfig
    elif arch in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vl"):  # hybrid: Gated DeltaNet + gated attention
        cfg = dict(
            common,
            num_hidden_layers=4,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
        )
        if arch == "qwen3_next":  # alternating, as the "Qwen3-Next" case
            cfg["layer_types"] = ["linear_attention", "full_attention"] * 2
            cls = Qwen3NextConfig
        else:  # three DeltaNets then one full attention (transformers' default interval of 4)
            del cfg["intermediate_size"]
            cls = Qwen3_5MoeTextConfig
    elif arch == "deepseek_v4":  # every mechanism within reach of 40-token prompts
        cfg = dict(
            common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            swiglu_limit=1.0,  # low enough that the tiny model's gate and up values get clamped
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            sliding_window=8,
            index_n_heads=8,  # ReLU scores of all heads zero (a tie top-k breaks as it likes) stay rare
            index_head_dim=16,
            index_topk=3,
            hc_mult=4,
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        )
        del cfg["intermediate_size"]
        cls = DeepseekV4Config
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    if arch == "qwen3_5_moe_vl":  # the released multimodal checkpoint: the text model under a vision tower
        vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4)
        return Qwen3_5MoeConfig(text_config=cls(**cfg).to_dict(), vision_config=vision, tie_word_embeddings=False)
    return cls(**cfg)


def write_checkpoint(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny checkpoint of `arch` written by transformers itself (for the `make_checkpoint`
    fixture and bench/gpu/parity.py)."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    if arch == "qwen3_5_moe_vl":
        model = Qwen3_5MoeForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0.0, 0.05)
    if arch == "deepseek_v4":
        randomize_deepseek_v4(model)
    hybrid = arch.startswith(("qwen3_next", "qwen3_5"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.normal_(0.0, 0.1)
            elif hybrid and name.endswith(("norm.weight", "dt_bias")):  # zero-centred norms start at 0
                param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def randomize_deepseek_v4(model: torch.nn.Module) -> None:
    """What DeepSeek-V4's init leaves zero or constant (sinks, pooling position biases, the
    hyper-connections' biases) drawn at random, and each token's `tid2eid` experts distinct, so
    every path of a tiny model shapes its output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.normal_(0.0, 0.5)
            elif name.endswith((".scale", "hc_scale")):
                param.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                vocab, top_k = buf.shape
                experts = model.config.n_routed_experts
                buf.copy_(torch.rand(vocab, experts).argsort(dim=-1)[:, :top_k])
