"""How a plan is shown: a table of the best layouts, the same as JSON, and the frontier plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeserve.loadtest.metrics import LatencyStats
from moeserve.plan.hardware import Hardware
from moeserve.plan.search import Candidate
from moeserve.plan.serving import ServingResult, Workload

COLUMNS = (
    "#",
    "layout",
    "batch",
    "chunk",
    "tok/s/GPU",
    "TBT p99 ms",
    "TTFT p99 ms",
    "goodput",
    "SLO met",
    "GPUs",
    "dominant",
)


def _ms(stats: LatencyStats | None, field: str = "p99") -> float | None:
    return None if stats is None else getattr(stats, field) * 1e3


def table(results: Sequence[ServingResult]) -> str:
    """One row a layout, best first; goodput is output tokens/s per GPU that met both SLOs."""
    rows = [COLUMNS]
    for i, r in enumerate(results, 1):
        dep = r.deployment
        rows.append(
            (
                str(i),
                dep.describe(),
                str(dep.max_batch),
                str(dep.chunk),
                f"{r.tok_s_per_gpu:.0f}",
                f"{_ms(r.tbt_s):.1f}",
                f"{_ms(r.ttft_s):.0f}",
                f"{r.goodput_tok_s_per_gpu:.0f}",
                f"{r.attainment:.0%}",
                str(dep.gpus),
                r.dominant,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def provenance_line(hw: Hardware) -> str:
    measured = [k for k, v in hw.provenance().items() if v == "measured"]
    return f"figures measured: {', '.join(measured) or 'none'}; every other figure assumed (moeserve/plan/hardware.py)"


def result_json(r: ServingResult) -> dict[str, Any]:
    dep = r.deployment
    return {
        "layout": dep.describe(),
        "decode": {"ep": dep.decode.ep, "tp": dep.decode.tp, "tbo": dep.decode.tbo, "instances": dep.decode_instances},
        "prefill": None
        if dep.prefill is None
        else {"ep": dep.prefill.ep, "tp": dep.prefill.tp, "tbo": dep.prefill.tbo, "instances": dep.prefill_instances},
        "max_batch": dep.max_batch,
        "chunk": dep.chunk,
        "gpus": dep.gpus,
        "rate_rps": r.rate,
        "tok_s_per_gpu": r.tok_s_per_gpu,
        "goodput_tok_s_per_gpu": r.goodput_tok_s_per_gpu,
        "attainment": r.attainment,
        "ttft_ms": {f: _ms(r.ttft_s, f) for f in ("median", "p90", "p99")},
        "tbt_ms": {f: _ms(r.tbt_s, f) for f in ("median", "p90", "p99")},
        "dominant": r.dominant,
    }


def document(
    model: str, hw: Hardware, workload: Workload, slo_ttft_s: float, slo_tbt_s: float, results: Sequence[ServingResult]
) -> dict[str, Any]:
    return {
        "tool": "moeserve plan",
        "model": model,
        "gpu": hw.gpu.name,
        "workload": {"isl": workload.isl, "osl": workload.osl, "rate_rps": workload.rate, "load": workload.load},
        "slo_ms": {"ttft": slo_ttft_s * 1e3, "tbt": slo_tbt_s * 1e3},
        "hardware": {name: {"value": getattr(hw, name), "source": source} for name, source in hw.provenance().items()},
        "results": [result_json(r) for r in results],
    }


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both: lower latency (x) and higher throughput (y)."""
    front, best = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def plot(candidates: Sequence[Candidate], results: Sequence[ServingResult], out: Path) -> Path:
    """Tokens/s per GPU against the full-batch step time a token waits (TBT), every screened
    layout, the frontier, and the simulated ones' p99 TBT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [(c.tbt_s * 1e3, c.tok_s_per_gpu) for c in candidates]
    if points:
        ax.scatter(*zip(*points), s=8, color="0.7", label="screened layouts (full batch)")
        front = pareto(points)
        ax.plot(*zip(*front), color="C0", marker="o", ms=3, label="frontier")
    if results:
        ax.scatter(
            [_ms(r.tbt_s) for r in results],
            [r.tok_s_per_gpu for r in results],
            color="C3",
            marker="x",
            label="simulated (TBT p99)",
        )
    ax.set_xlabel("TBT (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
