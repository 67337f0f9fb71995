"""Shared fixtures: tiny checkpoints written by transformers itself, with a locally trained tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 320  # 256 byte symbols + specials + a few merges: the smallest useful byte-level BPE


def hf_config(arch: str, **overrides: Any):
    """A transformers config for a tiny model of `arch`; overrides use HF's own field names."""
    from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
    elif arch == "deepseek_v3":
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
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    return cls(**cfg)


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeserve.checkpoints import train_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(VOCAB, folder)
    return folder


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[..., Path]:
    """make_checkpoint(arch, seed=0, **hf_overrides) -> folder, built once per distinct request.

    Weights come from transformers' own random init; DeepSeek's correction bias (zero at init)
    is randomised so that routing path is exercised.
    """
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def make(arch: str, seed: int = 0, **overrides: Any) -> Path:
        key = hashlib.sha1(json.dumps([arch, seed, overrides], sort_keys=True, default=str).encode()).hexdigest()[:10]
        if key not in built:
            built[key] = write_checkpoint(root / f"{arch}-{key}", tokenizer_dir, arch, seed, **overrides)
        return built[key]

    return make


def write_checkpoint(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny checkpoint of `arch` written by transformers itself (also used by bench/gpu/parity.py)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, with the reason, where there is no CUDA device (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
