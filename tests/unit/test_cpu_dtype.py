"""`--dtype auto` on CPU: float32 unless the CPU has bf16 instructions; explicit dtypes as given."""

from __future__ import annotations

import logging

import pytest
import torch

from moeserve import engine_config
from moeserve.cpu_features import cpuinfo_flags
from moeserve.engine_config import EngineConfig
from moeserve.llm import LLM

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\nbugs\t\t: sysret_ss_attrs\n"
X86_SPR = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_V9 = "processor\t: 0\nFeatures\t: fp asimd sve2 bf16 i8mm\nCPU implementer\t: 0x41\n"


def native_bf16(monkeypatch, present: bool) -> None:
    monkeypatch.setattr("moeserve.cpu_features.cpu_has_native_bf16", lambda: present)


def test_cpuinfo_flags_read_x86_and_arm():
    assert "avx2" in cpuinfo_flags(X86_AVX2) and "avx512_bf16" not in cpuinfo_flags(X86_AVX2)
    assert {"avx512_bf16", "amx_bf16"} <= cpuinfo_flags(X86_SPR)
    assert "bf16" in cpuinfo_flags(ARM_V9)
    assert cpuinfo_flags("") == frozenset()


@pytest.mark.parametrize(
    "present, device, given, expected",
    [
        (False, "cpu", "auto", "float32"),
        (False, "cpu", "bf16", "bfloat16"),  # explicit dtypes are kept
        (False, "cpu", "float16", "float16"),
        (True, "cpu", "auto", "auto"),  # native bf16: the checkpoint's own
        (False, "cuda", "auto", "auto"),  # GPUs always keep the checkpoint's dtype
    ],
)
def test_auto_dtype_follows_the_cpu(monkeypatch, present, device, given, expected):
    native_bf16(monkeypatch, present)
    assert EngineConfig(dtype=given, device=device).dtype == expected


def test_choice_is_logged_once(monkeypatch, caplog):
    native_bf16(monkeypatch, False)
    engine_config._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="moeserve.engine_config"):
        EngineConfig(device="cpu")
        EngineConfig(device="cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "dtype auto: float32, whatever the checkpoint's dtype (this CPU has no avx512_bf16 or amx_bf16)"
    ]


def test_bf16_checkpoint_loads_in_float32_without_native_bf16(tmp_path, monkeypatch):
    from moeserve.checkpoints import MakeModelSpec, make_model

    native_bf16(monkeypatch, False)
    folder = make_model(MakeModelSpec(arch="qwen3_moe", vocab=320, dtype="bfloat16"), tmp_path / "bf16")
    assert LLM(str(folder), max_model_len=64).engine.executor.model.embed_tokens.dtype == torch.float32
    explicit = LLM(str(folder), dtype="bfloat16", max_model_len=64)
    assert explicit.engine.executor.model.embed_tokens.dtype == torch.bfloat16
