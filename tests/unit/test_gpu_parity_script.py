"""bench/gpu/parity.py (the runbook's `parity` stage) on CPU: the same comparison the GPU runs, on
one architecture with the torch kernels, and its verdict arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _parity():
    name = "gpu_parity_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "gpu" / "parity.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_error_measures():
    parity = _parity()
    want = [torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[0.0, 0.0, 4.0], [3.0, 0.0, 0.0]])]
    got = [torch.tensor([[1.0, 2.5, 0.0]]), torch.tensor([[0.0, 5.0, 4.0], [3.0, 0.0, 0.0]])]
    errors = parity.logit_errors(got, want)
    assert errors["max_abs"] == 5.0
    assert abs(errors["rel"] - (25.25**0.5) / (30**0.5)) < 1e-6
    assert abs(errors["argmax_agree"] - 2 / 3) < 1e-9
    assert parity.leading_agreement([1, 2, 3], [1, 2, 4]) == 2
    assert parity.leading_agreement([1, 2], [1, 2]) == 2


def test_parity_on_cpu(tmp_path):
    out = tmp_path / "parity.json"
    argv = ["--device", "cpu", "--archs", "qwen3_moe", "--dtypes", "float32", "bfloat16", "--kernels", "torch"]
    assert _parity().main([*argv, "--max-tokens", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    fp32, bf16 = record["cases"]
    assert record["passed"] and fp32["passed"] and bf16["passed"]
    assert fp32["logits"]["max_abs"] < 1e-4 and fp32["greedy_leading_agreement"] == [2, 2, 2]
    assert 0 < bf16["logits"]["rel"] < 0.1 and 0 < bf16["transformers_rel"] < 0.1
