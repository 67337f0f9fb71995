"""Measured figures replace assumed ones, and the plan says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.plan.calibrate import calibrate
from moeserve.plan.cost import Layout, Work, step_cost
from moeserve.plan.hardware import Hardware
from moeserve.plan.shapes import load_shape

MOE_ROW = {
    "kind": "moe",
    "name": "deepseek_v3_ep8",
    "shape": {"name": "deepseek_v3_ep8", "hidden": 7168, "inter": 2048, "num_experts": 32, "top_k": 8},
    "tokens": 4096,
    "bf16_us": 1000.0,
    "fp8_us": 500.0,
}


def write(tmp_path: Path, name: str, doc) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def shape():
    return load_shape("qwen3-30b-a3b")


def test_gemm_rates_from_a_runbook_stage_record(tmp_path, shape):
    record = {"stage": "kernels", "commands": [{"result": {"device": "H100", "results": [MOE_ROW]}}]}
    hw = calibrate(Hardware.of("h100"), [write(tmp_path, "kernels.json", record)], shape)
    flops = 6 * 4096 * 8 * 7168 * 2048
    assert hw.bf16_flops == pytest.approx(flops / 1e-3)
    assert hw.fp8_flops == pytest.approx(flops / 5e-4)
    assert hw.provenance()["fp8_flops"] == "measured" and hw.provenance()["hbm_bw"] == "assumed"


def test_copy_bandwidth_from_dispatch_results(tmp_path, shape):
    hw = calibrate(Hardware.of("h100"), [write(tmp_path, "dispatch.json", {"copy": {"copy_gbps": 2500.0}})], shape)
    assert hw.hbm_bw == 2.5e12 and hw.measured == ("hbm_bw",)


def test_step_overhead_from_bench_serve(tmp_path, shape):
    run = {
        "request_throughput": 1.0,
        "num_completed": 10,
        "total_input_tokens": 1000,
        "total_output_tokens": 200,
        "tpot_ms": {"median": 50.0},
        "e2el_ms": {"mean": 1000.0},
    }
    doc = {"tool": "moeserve bench serve", "runs": [run, dict(run, request_throughput=5.0)]}
    base = Hardware.of("h100")
    hw = calibrate(base, [write(tmp_path, "serve.json", doc)], shape)
    modelled = step_cost(shape, base, Layout(), Work(decode_tokens=1.0, decode_ctx=100 + 20 / 2)).seconds
    assert hw.step_overhead_s == pytest.approx(0.05 - (modelled - base.step_overhead_s))
    assert hw.measured == ("step_overhead_s",)


def test_a_file_with_nothing_measured_is_refused(tmp_path, shape):
    with pytest.raises(ValueError, match="no figure found"):
        calibrate(Hardware.of("h100"), [write(tmp_path, "other.json", {"x": 1})], shape)
    with pytest.raises(ValueError, match="--calibrate"):
        calibrate(Hardware.of("h100"), [tmp_path / "missing.json"], shape)
