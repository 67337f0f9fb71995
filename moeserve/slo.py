"""Per-request latency targets and the named classes they are reported under.

A request may carry its own TTFT and TBT targets (`RequestSLO`); the scheduler orders, sizes
chunks and admits by them, and the attainment counters judge it by them. /metrics labels each
verdict by a class (`--slo-class chat=ttft:500,tbt:50`), never by the raw targets, so a client
that sends arbitrary numbers cannot grow the number of series: targets that match no class are
counted as "custom".

Imports nothing heavy: the command's parser and the scheduler both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_CLASS = "default"
"""The label of requests judged against the server's own --slo-ttft-ms/--slo-tbt-ms."""
CUSTOM_CLASS = "custom"
"""The label of requests whose own targets match no class."""


def _check_target(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class RequestSLO:
    """The targets one request is scheduled, admitted and judged by, and the class it counts under."""

    ttft_s: float
    tbt_s: float
    label: str = CUSTOM_CLASS

    def __post_init__(self) -> None:
        _check_target("slo ttft", self.ttft_s)
        _check_target("slo tbt", self.tbt_s)


@dataclass(frozen=True)
class SLOClass:
    """A named pair of targets a request can ask for by name (`slo: {"class": NAME}`)."""

    name: str
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"SLO class name must be letters, digits, '-' or '_', got {self.name!r}")
        if self.name in (DEFAULT_CLASS, CUSTOM_CLASS):
            raise ValueError(f"SLO class name {self.name!r} is reserved")
        _check_target(f"class {self.name} ttft", self.ttft_s)
        _check_target(f"class {self.name} tbt", self.tbt_s)

    @property
    def targets(self) -> RequestSLO:
        return RequestSLO(self.ttft_s, self.tbt_s, self.name)


def parse_slo_class(text: str) -> SLOClass:
    """`NAME=ttft:MS,tbt:MS` (the --slo-class flag) -> an SLOClass in seconds."""
    name, sep, spec = text.partition("=")
    parts = dict(p.partition(":")[::2] for p in spec.split(",")) if sep else {}
    if set(parts) != {"ttft", "tbt"}:
        raise ValueError(f"--slo-class takes NAME=ttft:MS,tbt:MS, got {text!r}")
    try:
        ttft_ms, tbt_ms = float(parts["ttft"]), float(parts["tbt"])
    except ValueError:
        raise ValueError(f"--slo-class targets must be numbers of milliseconds, got {text!r}") from None
    return SLOClass(name.strip(), ttft_ms / 1000.0, tbt_ms / 1000.0)


@dataclass(frozen=True)
class SLOCatalog:
    """The server's default targets and its named classes: what a request's `slo` field resolves to."""

    default: RequestSLO
    classes: tuple[SLOClass, ...] = ()

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"SLO class names must be unique, got {names}")

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label a verdict can carry, for /metrics."""
        return (DEFAULT_CLASS, *(c.name for c in self.classes), CUSTOM_CLASS)

    def named(self, name: str) -> RequestSLO:
        for c in self.classes:
            if c.name == name:
                return c.targets
        known = ", ".join(c.name for c in self.classes) or "none are defined (--slo-class)"
        raise ValueError(f"unknown SLO class {name!r}; known classes: {known}")

    def resolve(self, ttft_s: float | None, tbt_s: float | None) -> RequestSLO:
        """Targets given on a request, the missing ones from the default, labelled by the first
        class (the default first) whose targets they equal, else "custom"."""
        ttft = self.default.ttft_s if ttft_s is None else ttft_s
        tbt = self.default.tbt_s if tbt_s is None else tbt_s
        _check_target("slo.ttft_ms", ttft)
        _check_target("slo.tbt_ms", tbt)
        for label, target in ((DEFAULT_CLASS, self.default), *((c.name, c.targets) for c in self.classes)):
            if math.isclose(ttft, target.ttft_s) and math.isclose(tbt, target.tbt_s):
                return RequestSLO(ttft, tbt, label)
        return RequestSLO(ttft, tbt, CUSTOM_CLASS)
