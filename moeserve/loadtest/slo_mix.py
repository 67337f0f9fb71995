"""A mix of SLO classes in one load (`--slo-mix`): which request belongs to which class, and how
each class fared, as the client saw it and as the server's per-class counters say.

`chat:0.7:ttft=500,tbt=50;batch:0.3:ttft=20000,tbt=200` is two classes: 70% of the requests
(drawn with the run's seed, the same draw for every run) carry `slo: {"ttft_ms": 500,
"tbt_ms": 50}`, the rest the batch targets. Each class is judged against its own targets:

- client side, over the requests sent: attainment of TTFT, of TBT (every gap) and of both, and
  goodput (requests/s meeting both); the same attainment over the admitted requests only
  (those not refused with HTTP 429), which is what admission control promises;
- server side, from the deltas of `moeserve:slo_class_*_total{class}` and
  `moeserve:slo_rejections_total{class}` around the run. The server labels a request by the
  `--slo-class` whose targets equal its own, so start it with the same classes
  (`--slo-class chat=ttft:500,tbt:50 ...`); a class it does not know shows as unavailable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from moeserve.loadtest.metrics import Objectives, RequestMetrics, attainment, meets_all

CLASS_COUNTERS = {
    "moeserve:slo_class_requests_total": "requests",
    "moeserve:slo_class_ttft_met_requests_total": "ttft_met",
    "moeserve:slo_class_tbt_met_requests_total": "tbt_met",
    "moeserve:slo_rejections_total": "rejections",
}
_SPEC_HELP = "NAME:WEIGHT:ttft=MS,tbt=MS;... e.g. chat:0.7:ttft=500,tbt=50;batch:0.3:ttft=20000,tbt=200"


@dataclass(frozen=True)
class MixClass:
    """One class of the mix: its share of the requests and the targets they carry (seconds)."""

    name: str
    weight: float
    ttft_s: float
    tbt_s: float

    @property
    def objectives(self) -> Objectives:
        return Objectives(ttft=self.ttft_s, tbt=self.tbt_s)

    @property
    def targets_ms(self) -> tuple[float, float]:
        """(TTFT, TBT) in ms, as the request's `slo` field carries them."""
        return self.ttft_s * 1000.0, self.tbt_s * 1000.0


def parse_slo_mix(text: str) -> tuple[MixClass, ...]:
    """The --slo-mix flag -> its classes; ValueError naming what is wrong and the expected form."""
    classes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError(f"--slo-mix: {part!r} is not NAME:WEIGHT:ttft=MS,tbt=MS (expected {_SPEC_HELP})")
        name, weight_text, targets_text = (f.strip() for f in fields)
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--slo-mix: class name {name!r} must be letters, digits, '-' or '_'")
        targets = dict(t.strip().partition("=")[::2] for t in targets_text.split(","))
        if set(targets) != {"ttft", "tbt"}:
            raise ValueError(f"--slo-mix: class {name!r} needs exactly ttft=MS,tbt=MS, got {targets_text!r}")
        weight, ttft_ms, tbt_ms = (
            _positive(value, f"class {name!r} {what}")
            for what, value in (("weight", weight_text), ("ttft", targets["ttft"]), ("tbt", targets["tbt"]))
        )
        classes.append(MixClass(name, weight, ttft_ms / 1000.0, tbt_ms / 1000.0))
    if not classes:
        raise ValueError(f"--slo-mix names no class (expected {_SPEC_HELP})")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"--slo-mix names a class twice: {names}")
    return tuple(classes)


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"--slo-mix: {what} must be a positive number, got {text!r}")
    return value


def assign_classes(num_requests: int, mix: Sequence[MixClass], seed: int) -> list[int]:
    """The class (an index into `mix`) of each request, drawn by weight with its own seeded
    generator, so the draw does not shift the prompts' or the arrivals' random streams."""
    rng = random.Random(f"slo-mix:{seed}")
    return rng.choices(range(len(mix)), weights=[c.weight for c in mix], k=num_requests)


@dataclass(frozen=True)
class ClassCounts:
    """The server's per-class counters (summed over models), or their change over a run."""

    requests: float = 0.0
    ttft_met: float = 0.0
    tbt_met: float = 0.0
    rejections: float = 0.0

    def minus(self, before: ClassCounts) -> ClassCounts:
        return ClassCounts(*(a - b for a, b in zip(vars(self).values(), vars(before).values())))


def parse_class_counters(text: str) -> dict[str, ClassCounts]:
    """Per-class SLO counters in a Prometheus text exposition, by class label."""
    sums: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = CLASS_COUNTERS.get(sample.name)
            if field is not None and "class" in sample.labels:
                counts = sums.setdefault(sample.labels["class"], {})
                counts[field] = counts.get(field, 0.0) + sample.value
    return {label: ClassCounts(**counts) for label, counts in sums.items()}


@dataclass(frozen=True)
class ClassReport:
    """How one class fared in one run."""

    name: str
    ttft_s: float
    tbt_s: float
    num_sent: int
    num_rejected: int
    """Refused at once with HTTP 429 (admission control)."""
    num_completed: int
    goodput: float
    """Requests/s of the run's duration that met both targets."""
    attainment: dict[str, float]
    """Over every request sent (refusals are misses): ttft, tbt, all."""
    admitted_attainment: dict[str, float]
    """Over the requests not refused."""
    server: ClassCounts | None
    """The server's counter deltas for this class; None when it exports no such class."""


def class_reports(
    mix: Sequence[MixClass],
    class_of: Sequence[int],
    requests: Sequence[RequestMetrics],
    duration_s: float,
    server_deltas: dict[str, ClassCounts] | None,
) -> tuple[ClassReport, ...]:
    """Each class's figures; `class_of[m.index]` is request m's class, `server_deltas` the
    per-class counter changes over the run (None: not read)."""
    reports = []
    for index, cls in enumerate(mix):
        mine = [m for m in requests if class_of[m.index] == index]
        admitted = [m for m in mine if not _rejected(m)]
        good = sum(meets_all(m, cls.objectives) for m in mine)
        reports.append(
            ClassReport(
                name=cls.name,
                ttft_s=cls.ttft_s,
                tbt_s=cls.tbt_s,
                num_sent=len(mine),
                num_rejected=len(mine) - len(admitted),
                num_completed=sum(m.ok for m in mine),
                goodput=good / duration_s if duration_s > 0 else 0.0,
                attainment=attainment(mine, cls.objectives),
                admitted_attainment=attainment(admitted, cls.objectives),
                server=None if server_deltas is None else server_deltas.get(cls.name),
            )
        )
    return tuple(reports)


def _rejected(m: RequestMetrics) -> bool:
    return m.error == "http_4xx" and m.error_detail.startswith("HTTP 429")


def class_json(r: ClassReport) -> dict[str, Any]:
    server = None
    if r.server is not None:
        judged = r.server.requests
        server = {
            "requests": judged,
            "rejections": r.server.rejections,
            "ttft": r.server.ttft_met / judged if judged else None,
            "tbt": r.server.tbt_met / judged if judged else None,
        }
    return {
        "name": r.name,
        "targets_ms": {"ttft": r.ttft_s * 1000.0, "tbt": r.tbt_s * 1000.0},
        "num_sent": r.num_sent,
        "num_rejected": r.num_rejected,
        "num_completed": r.num_completed,
        "goodput": r.goodput,
        "attainment": r.attainment,
        "admitted_attainment": r.admitted_attainment,
        "server": server,
    }


def class_table(reports: Sequence[ClassReport]) -> str:
    """Per class: sent, refused, goodput, attainment (sent and admitted), the server's own."""

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100.0 * value:.1f}%"

    lines = [
        " Per SLO class ".center(64, "-"),
        f"{'class':<10}{'sent':>6}{'429':>6}{'goodput':>9}{'all':>8}{'admitted':>10}{'server ttft/tbt':>17}",
    ]
    for r in reports:
        s = r.server
        server = "-" if s is None or not s.requests else f"{pct(s.ttft_met / s.requests)}/{pct(s.tbt_met / s.requests)}"
        lines.append(
            f"{r.name:<10}{r.num_sent:>6}{r.num_rejected:>6}{r.goodput:>9.2f}{pct(r.attainment.get('all')):>8}"
            f"{pct(r.admitted_attainment.get('all')):>10}{server:>17}"
        )
    return "\n".join(lines)
