"""Shared fixtures: tiny checkpoints written by transformers itself, with a locally trained tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hf_configs import VOCAB, write_checkpoint

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

    Weights come from transformers' own random init; the correction biases of sigmoid routers
    and gpt-oss's expert biases (zero at init) are randomised so that their paths are exercised.
    """
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def make(arch: str, seed: int = 0, **overrides: Any) -> Path:
        key = hashlib.sha1(json.dumps([arch, seed, overrides], sort_keys=True, default=str).encode()).hexdigest()[:10]
        if key not in built:
            built[key] = write_checkpoint(root / f"{arch}-{key}", tokenizer_dir, arch, seed, **overrides)
        return built[key]

    return make


# Folders whose files each take minutes (server launches, rank processes), run first: with
# `-n 2 --dist loadfile` the workers take files in collection order, and a long file started
# last keeps one worker busy alone at the end.
HEAVY_FIRST = ("server", "distributed", "parity")


def _heaviness(item: pytest.Item) -> int:
    folder = item.path.parent.name
    return HEAVY_FIRST.index(folder) if folder in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heavy folders first (a stable sort: each file keeps its tests' order); tests marked `gpu`
    skip, with the reason, where there is no CUDA device (CI)."""
    items.sort(key=_heaviness)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
