"""Measured figures in place of assumed ones, from the files this repository's benchmarks write.

`moeserve plan --calibrate FILE...` reads each file and replaces what it measured:

* `bench/fp8_gemm.py` results (alone or inside a `bench/gpu/run.sh` stage record): the grouped
  MoE rows' best achieved rate, 6 T K H I FLOPs (gate/up and down) over the timed microseconds,
  bf16 and FP8, replaces `bf16_flops` and `fp8_flops`.
* `bench/dispatch.py` results: `copy.copy_gbps`, a device-to-device copy's read + write bytes
  per second, replaces `hbm_bw`.
* `moeserve bench serve` results: the lowest-rate run's median TPOT is a decode step at the
  concurrency Little's law gives (request rate times mean end-to-end latency); what the cost
  model's step at that batch lacks of it becomes `step_overhead_s`. This reads the run as
  serving the planned model on one GPU (ep = tp = 1), the only layout such a file implies.

A file that holds none of these is refused, so a typo does not silently plan on assumptions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moeserve.plan.cost import Layout, Work, step_cost
from moeserve.plan.hardware import Hardware
from moeserve.plan.shapes import ModelShape


def _dicts(node: Any) -> Iterator[dict]:
    """Every dict in a JSON document, depth first (stage records nest script results)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _dicts(v)
    elif isinstance(node, list):
        for v in node:
            yield from _dicts(v)


def gemm_rates(doc: Any) -> dict[str, float]:
    """Best achieved FLOP/s of the grouped MoE GEMM rows, bf16 and FP8."""
    best: dict[str, float] = {}
    for d in _dicts(doc):
        shape = d.get("shape")
        if d.get("kind") != "moe" or not isinstance(shape, dict) or "fp8_us" not in d:
            continue
        flops = 6 * d["tokens"] * shape["top_k"] * shape["hidden"] * shape["inter"]
        for key, field in (("bf16_us", "bf16_flops"), ("fp8_us", "fp8_flops")):
            if d.get(key, 0) > 0:
                best[field] = max(best.get(field, 0.0), flops / (d[key] * 1e-6))
    return best


def copy_bandwidth(doc: Any) -> dict[str, float]:
    for d in _dicts(doc):
        if isinstance(d.get("copy"), dict) and d["copy"].get("copy_gbps", 0) > 0:
            return {"hbm_bw": d["copy"]["copy_gbps"] * 1e9}
    return {}


def step_overhead(doc: Any, shape: ModelShape, hw: Hardware) -> dict[str, float]:
    """The host time per step a `bench serve` file shows beyond the modelled step."""
    if not isinstance(doc, dict) or doc.get("tool") != "moeserve bench serve":
        return {}
    runs = [r for r in doc.get("runs", []) if r.get("tpot_ms") and r.get("e2el_ms")]
    if not runs:
        return {}
    run = min(runs, key=lambda r: r["request_throughput"])
    batch = max(1.0, run["request_throughput"] * run["e2el_ms"]["mean"] / 1e3)
    tokens_in = run["total_input_tokens"] / max(run["num_completed"], 1)
    tokens_out = run["total_output_tokens"] / max(run["num_completed"], 1)
    work = Work(decode_tokens=batch, decode_ctx=tokens_in + tokens_out / 2)
    modelled = step_cost(shape, hw, Layout(), work).seconds - hw.step_overhead_s
    return {"step_overhead_s": max(0.0, run["tpot_ms"]["median"] / 1e3 - modelled)}


def calibrate(hw: Hardware, files: list[Path], shape: ModelShape) -> Hardware:
    """`hw` with every figure the files measured replaced (a later file wins)."""
    for path in files:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibrate {path}: {e}") from None
        found = gemm_rates(doc) | copy_bandwidth(doc) | step_overhead(doc, shape, hw)
        if not found:
            raise ValueError(
                f"--calibrate {path}: no figure found (expected bench/fp8_gemm.py, bench/dispatch.py or "
                "`moeserve bench serve` results)"
            )
        hw = hw.with_measured(**found)
    return hw
