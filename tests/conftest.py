"""Shared fixtures: tiny checkpoints written by transformers itself, with a locally trained tokenizer.

Without CUDA the Triton kernels run under Triton's interpreter, which must be chosen before triton
is first imported (its standard library, `tl.sum` and the like, is decorated then): hence here,
before any test module is collected, since a collected module that imports a kernel imports
triton. Tests that compile for a GPU target (the compile check's) do it in a child process
without the variable.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.hf_configs import VOCAB, write_checkpoint  # noqa: E402

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


# The longest files first, longest first (seconds of one file under `-n 2`, measured on 2 cores):
# with `-n 2 --dist loadfile` each worker takes the next file in collection order when it is
# free, so a long file collected late would run alone at the end. Files not named here follow
# in their usual order.
LONGEST_FIRST = (
    "test_multi_host.py",  # ~210 (skipped where network namespaces cannot be made)
    "test_openai_server.py",  # ~150
    "test_nvshmem_dispatcher.py",  # ~95
    "test_fp8_checkpoints.py",  # ~90 (three ep=4 runs)
    "test_ep_parity.py",  # ~75
    # Disaggregation: three servers and a router each (estimated: timed only under a load of ~18)
    "test_disaggregation_server.py",  # ~75?
    "test_disaggregation_failures_server.py",  # ~60?
    "test_disaggregation_mla_server.py",  # ~60?
    "test_disaggregation_decode_death_server.py",  # ~40?
    "test_bench_serve.py",  # ~70
    "test_ep_serving.py",  # ~65
    "test_docs_examples.py",  # ~60 (two servers; 140 s under a load average of 20)
    "test_responses_server.py",  # ~60? (three servers)
    "test_transformers_parity.py",  # ~55
    "test_heal_serving.py",  # ~55
    "test_server_safety.py",  # ~50
    "test_shutdown_server.py",  # ~50? (three servers; 105 s under load)
    "test_cli.py",  # ~45
    "test_dsa_ep_parity.py",  # ~25 single-threaded (four ep=4 runs)
    "test_dashboards.py",  # ~45
    "test_eplb_server.py",  # ~35
    "test_openapi_fuzz.py",  # ~35? (every route; 68 s under load)
    "test_torch_dispatcher.py",  # ~30
    "test_structured_server.py",  # ~30
    "test_harmony_server.py",  # ~30
    "test_engine.py",  # ~30
    "test_spec_decode_engine.py",  # ~30
    "test_spec_decode_ep.py",  # ~60 (four ep=4 runs; estimated, measured only on a loaded machine)
    "test_spec_decode_mtp.py",  # ~45 (estimated, measured only on a loaded machine)
    "test_spec_decode_logprobs.py",  # ~30
    "test_spec_decode_penalties.py",  # ~25
    "test_gpu_runbook.py",  # ~20
    "test_fp8_model_kernels.py",  # ~20
    "test_fp8_dispatchers.py",  # ~20
    "test_host_syncs_ep.py",  # ~20
    "test_heal_quantized.py",  # ~20
)


def _start_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (a stable sort: each file keeps its tests' order); tests marked
    `gpu` skip, with the reason, where there is no CUDA device (CI)."""
    items.sort(key=_start_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
