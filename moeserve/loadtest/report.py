"""What a benchmark shows: terminal tables, the JSON document (schema in docs/bench-serve.md) and
PNG plots. Latencies are stored in seconds and shown in milliseconds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moeserve.loadtest.metrics import LatencyStats, Objectives, RequestMetrics
from moeserve.loadtest.promcheck import CrossCheck
from moeserve.loadtest.runner import RunReport
from moeserve.loadtest.search import SearchResult, SearchSettings
from moeserve.loadtest.slo_mix import class_json, class_table

SCHEMA_VERSION = 1
_LATENCIES = (("ttft", "TTFT"), ("tbt", "TBT (every gap)"), ("tpot", "TPOT"), ("e2el", "E2EL"))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def json_rate(rate: float) -> float | str:
    """JSON has no infinity: an unbounded rate is the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def _rate_text(rate: float) -> str:
    return "inf req/s (all at once)" if math.isinf(rate) else f"{rate:.4g} req/s"


# ---- JSON ------------------------------------------------------------------------------------


def _stats_json(stats: LatencyStats | None) -> dict[str, float] | None:
    if stats is None:
        return None
    ms = stats.scaled(1000.0)
    return {"count": ms.count, "mean": ms.mean, "median": ms.median, "p90": ms.p90, "p99": ms.p99, "max": ms.max}


def _request_json(m: RequestMetrics) -> dict[str, Any]:
    return {
        "index": m.index,
        "ok": m.ok,
        "error": m.error,
        "error_detail": m.error_detail,
        "send_time_s": m.send_offset,
        "prompt_tokens": m.prompt_tokens,
        "output_tokens": m.output_tokens,
        "token_source": m.token_source,
        "ttft_ms": _ms(m.ttft),
        "tpot_ms": _ms(m.tpot),
        "e2el_ms": _ms(m.e2el),
        "tbt_ms": [g * 1000.0 for g in m.gaps],
    }


def _cross_check_json(c: CrossCheck) -> dict[str, Any]:
    def pair(ttft: float | None, tbt: float | None) -> dict[str, float] | None:
        return None if ttft is None else {"ttft": ttft, "tbt": tbt}

    return {
        "available": c.available,
        "reason": c.reason,
        "targets_ms": pair(_ms(c.ttft_target_s), _ms(c.tbt_target_s)),
        "server_requests": c.server_requests,
        "client_requests": c.client_requests,
        "server": pair(c.server_ttft, c.server_tbt),
        "client": pair(c.client_ttft, c.client_tbt),
        "mean_accepted_length": c.mean_accepted_length,
    }


def run_json(report: RunReport) -> dict[str, Any]:
    s = report.summary
    return {
        "request_rate": json_rate(report.request_rate),
        "duration_s": s.duration_s,
        "num_prompts": report.planned,
        "num_sent": s.num_sent,
        "num_completed": s.num_completed,
        "num_failed": s.num_failed,
        "errors": s.errors,
        "total_input_tokens": s.total_input_tokens,
        "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput,
        "output_throughput": s.output_throughput,
        "goodput": s.goodput,
        "attainment": s.attainment,
        **{f"{kind}_ms": _stats_json(getattr(s, kind)) for kind, _ in _LATENCIES},
        "cross_check": _cross_check_json(report.cross_check),
        "slo_classes": [class_json(c) for c in report.classes],
        "requests": [_request_json(m) for m in report.requests],
    }


def search_json(search: SearchResult, settings: SearchSettings, reports: Sequence[RunReport]) -> dict[str, Any]:
    at_max = [r.summary.goodput for r in reports if r.request_rate == search.max_rate]
    return {
        "target_attainment": settings.target,
        "start_rate": settings.start_rate,
        "tolerance": settings.tolerance,
        "max_probes": settings.max_probes,
        "max_goodput_rate": search.max_rate,
        "goodput_at_max_rate": at_max[-1] if at_max else None,
        "min_failing_rate": search.min_failing_rate,
        "bracketed": search.bracketed,
        "probes": [{"request_rate": p.rate, "attainment": p.attainment, "passed": p.passed} for p in search.probes],
    }


def document(
    mode: str, config: dict[str, Any], reports: Sequence[RunReport], search: dict[str, Any] | None
) -> dict[str, Any]:
    """The whole result file; `search` is `search_json(...)` in search mode, else None."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "moeserve bench serve",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "config": config,
        "runs": [run_json(r) for r in reports],
        "search": search,
    }


# ---- terminal --------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_table(report: RunReport, objectives: Objectives) -> str:
    """The full summary of one run, in the spirit of `vllm bench serve`."""
    s = report.summary
    width = 64
    lines = [f" Serving benchmark at {_rate_text(report.request_rate)} ".center(width, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<44}{value:>20}")

    row("Requests: sent / completed / failed", f"{s.num_sent} / {s.num_completed} / {s.num_failed}")
    if s.num_sent < report.planned:
        row("  not sent (--duration ran out)", str(report.planned - s.num_sent))
    row("Benchmark duration (s)", _num(s.duration_s))
    row("Total input tokens", str(s.total_input_tokens))
    row("Total output tokens", str(s.total_output_tokens))
    row("Request throughput (req/s)", _num(s.request_throughput))
    row("Output token throughput (tok/s)", _num(s.output_throughput))
    row("Goodput (req/s meeting every objective)", _num(s.goodput))
    lines.append(f"{'latency (ms)':<16}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}{'max':>9}{'n':>7}")
    for kind, label in _LATENCIES:
        stats = getattr(s, kind)
        if stats is None:
            lines.append(f"{label:<16}{'no completed request':>48}")
            continue
        ms = stats.scaled(1000.0)
        lines.append(
            f"{label:<16}{ms.mean:>9.2f}{ms.median:>9.2f}{ms.p90:>9.2f}{ms.p99:>9.2f}{ms.max:>9.2f}{ms.count:>7}"
        )
    if s.attainment:
        lines.append(" SLO attainment ".center(width, "-"))
        for kind, target in objectives.given().items():
            what = "every gap" if kind == "tbt" else kind.upper()
            row(f"{kind} ({what} <= {target * 1000:g} ms)", _pct(s.attainment[kind]))
        row("all objectives", _pct(s.attainment["all"]))
    if s.errors:
        lines.append(" Errors ".center(width, "-"))
        for kind, count in s.errors.items():
            row(kind, str(count))
        example = next(m for m in report.requests if not m.ok)
        lines.append(f"  e.g. request {example.index}: {example.error_detail[:200]}")
    if report.classes:
        lines.append(class_table(report.classes))
    lines.append(cross_check_text(report.cross_check))
    lines.append("=" * width)
    return "\n".join(lines)


def cross_check_text(c: CrossCheck) -> str:
    if not c.available:
        return f"Cross-check with server /metrics skipped: {c.reason}"
    return "\n".join(
        [
            " Cross-check with server /metrics ".center(64, "-"),
            f"server targets: TTFT {c.ttft_target_s * 1000:g} ms, TBT {c.tbt_target_s * 1000:g} ms; "
            f"requests: server {c.server_requests}, client {c.client_requests}",
            f"{'attainment':<24}{'client':>12}{'server':>12}",
            f"{'TTFT met':<24}{_pct(c.client_ttft):>12}{_pct(c.server_ttft):>12}",
            f"{'TBT met (every gap)':<24}{_pct(c.client_tbt):>12}{_pct(c.server_tbt):>12}",
            *(
                []
                if c.mean_accepted_length is None
                else [f"speculative decoding: mean accepted length {c.mean_accepted_length:.2f} (server)"]
            ),
        ]
    )


def rate_table(reports: Sequence[RunReport], search: SearchResult | None = None) -> str:
    """One line per run (a sweep's rates, or a search's probes in the order they ran)."""
    header = (
        f"{'rate':>10}{'sent':>6}{'ok':>6}{'req/s':>8}{'tok/s':>9}{'goodput':>9}{'attain':>8}"
        f"{'TTFT p99':>10}{'TBT p99':>9}  server TTFT/TBT"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        s = r.summary
        c = r.cross_check
        server = f"{_pct(c.server_ttft)}/{_pct(c.server_tbt)}" if c.available else "-"
        ttft = _num(_ms(s.ttft.p99 if s.ttft else None), 1)
        tbt = _num(_ms(s.tbt.p99 if s.tbt else None), 1)
        rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:.4g}"
        lines.append(
            f"{rate:>10}{s.num_sent:>6}{s.num_completed:>6}{s.request_throughput:>8.2f}{s.output_throughput:>9.1f}"
            f"{_num(s.goodput):>9}{_pct(s.attainment.get('all')):>8}{ttft:>10}{tbt:>9}  {server}"
        )
    if search is not None:
        if search.max_rate is None:
            lines.append(
                f"No probed rate met the attainment target (lowest tried: {min(p.rate for p in search.probes):.4g} "
                "req/s)."
            )
        elif not search.bracketed:
            lines.append(
                f"Every probed rate met the target; the highest, {search.max_rate:.4g} req/s, is a lower bound (raise "
                "--search-max-probes)."
            )
        else:
            lines.append(
                f"Max goodput rate: {search.max_rate:.4g} req/s (the lowest failing rate was "
                f"{search.min_failing_rate:.4g} req/s)"
            )
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------


def _cdf(ax: Any, values_ms: Sequence[float], label: str | None, color: Any) -> None:
    ordered = sorted(values_ms)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label, color=color)


def _latency_samples(report: RunReport) -> dict[str, list[float]]:
    done = [m for m in report.requests if m.ok]
    return {
        "ttft": [m.ttft * 1000 for m in done],
        "tbt": [g * 1000 for m in done for g in m.gaps],
        "e2el": [m.e2el * 1000 for m in done],
    }


def _cdf_row(axes: Sequence[Any], reports: Sequence[RunReport], objectives: Objectives) -> None:
    from matplotlib import colormaps

    by_rate = sorted(reports, key=lambda r: r.request_rate)  # colour follows rate, whatever order they ran in
    cmap = colormaps["viridis"]
    for ax, (kind, title) in zip(axes, (("ttft", "TTFT"), ("tbt", "TBT (every gap)"), ("e2el", "E2E latency"))):
        for i, report in enumerate(by_rate):
            values = _latency_samples(report)[kind]
            if values:
                several = len(by_rate) > 1
                _cdf(
                    ax,
                    values,
                    _rate_text(report.request_rate) if several else None,
                    cmap(i / max(len(by_rate) - 1, 1)) if several else "tab:blue",
                )
        target = getattr(objectives, kind)
        if target is not None:
            ax.axvline(target * 1000, color="tab:red", linestyle="--", label=f"objective {target * 1000:g} ms")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if kind == "tbt" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")


def _rate_row(
    axes: Sequence[Any],
    reports: Sequence[RunReport],
    objectives: Objectives,
    search: SearchResult | None,
    target: float | None,
) -> None:
    ordered = sorted(reports, key=lambda r: r.request_rate)
    rates = [r.request_rate for r in ordered]

    def p99_ms(kind: str) -> list[float]:
        return [math.nan if getattr(r.summary, kind) is None else getattr(r.summary, kind).p99 * 1000 for r in ordered]

    for ax, kind, title in ((axes[0], "ttft", "TTFT p99"), (axes[1], "tbt", "TBT p99 (every gap)")):
        ax.plot(rates, p99_ms(kind), marker="o", color="tab:blue", label="client")
        objective = getattr(objectives, kind)
        if objective is not None:
            ax.axhline(objective * 1000, color="tab:red", linestyle="--", label=f"objective {objective * 1000:g} ms")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs request rate")
    ax = axes[2]
    ax.plot(rates, rates, color="0.6", linestyle=":", label="offered")
    ax.plot(rates, [r.summary.request_throughput for r in ordered], marker="s", color="tab:gray", label="throughput")
    ax.set_ylabel("requests/s")
    ax.set_title("Goodput and attainment vs request rate")
    extra: list[Any] = []
    if objectives.given():
        ax.plot(rates, [r.summary.goodput for r in ordered], marker="o", color="tab:green", label="goodput")
        twin = ax.twinx()
        extra = twin.plot(
            rates,
            [100 * r.summary.attainment["all"] for r in ordered],
            marker="^",
            color="tab:orange",
            label="attainment (all)",
        )
        if target is not None:
            extra.append(
                twin.axhline(
                    100 * target, color="tab:orange", linestyle="--", linewidth=0.8, label=f"target {100 * target:g}%"
                )
            )
        twin.set_ylabel("SLO attainment, all objectives (%)", color="tab:orange")
        twin.set_ylim(0, 105)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        if search is not None and search.max_rate is not None:
            ax.axvline(
                search.max_rate,
                color="tab:purple",
                linestyle="-.",
                linewidth=1,
                label=f"max goodput rate {search.max_rate:.3g}",
            )
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    handles, labels = axes[2].get_legend_handles_labels()
    axes[2].legend(handles + extra, labels + [h.get_label() for h in extra], fontsize=7, loc="best")


def plot(
    path: Path,
    reports: Sequence[RunReport],
    objectives: Objectives,
    search: SearchResult | None = None,
    target: float | None = None,
) -> None:
    """One run: CDFs of TTFT, TBT gaps and E2EL with the objectives. Several (a sweep or a
    search): TTFT p99, TBT p99 and goodput/attainment against rate, above the CDFs of every run."""
    from matplotlib.figure import Figure

    several = len(reports) > 1
    fig = Figure(figsize=(16, 9.5 if several else 4.8), layout="constrained")
    axes = fig.subplots(2 if several else 1, 3, squeeze=False)
    if several:
        _rate_row(axes[0], reports, objectives, search, target)
    _cdf_row(axes[-1], reports, objectives)
    if search is not None and search.max_rate is not None:
        title = f"search: max goodput rate {search.max_rate:.4g} req/s" + (
            f" (attainment >= {100 * target:g}%)" if target is not None else ""
        )
    elif several:
        title = f"sweep over {len(reports)} rates"
    else:
        title = _rate_text(reports[0].request_rate)
    fig.suptitle(f"moeserve bench serve: {title}")
    fig.savefig(path, dpi=100)
