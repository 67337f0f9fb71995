"""`moeserve bench serve`: an SLO load-test harness for any OpenAI-compatible server.

    from moeserve.loadtest import BenchConfig, Objectives, bench_serve
    result = asyncio.run(bench_serve(BenchConfig("http://127.0.0.1:8000", request_rate=4.0,
                                                 objectives=Objectives(ttft=0.5, tbt=0.05))))
    result.document  # the JSON result (docs/bench-serve.md)

It talks to the server only over HTTP (the OpenAI API and, for the cross-check, /metrics), so it
imports nothing of the server. The names below load on first use: the `moeserve` command builds
its parser (and so imports this package) on every start, and a server launch should not pay for
the load generator's HTTP client; nor may the package import `cli` before
`python -m moeserve.loadtest.cli` runs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeserve.loadtest.cli import add_bench_parser, main
    from moeserve.loadtest.metrics import Objectives
    from moeserve.loadtest.serve import BenchConfig, BenchResult, bench_serve
    from moeserve.loadtest.slo_mix import MixClass, parse_slo_mix

_LAZY = {
    "add_bench_parser": "cli",
    "main": "cli",
    "BenchConfig": "serve",
    "BenchResult": "serve",
    "bench_serve": "serve",
    "Objectives": "metrics",
    "MixClass": "slo_mix",
    "parse_slo_mix": "slo_mix",
}

__all__ = [
    "BenchConfig",
    "BenchResult",
    "MixClass",
    "Objectives",
    "add_bench_parser",
    "bench_serve",
    "main",
    "parse_slo_mix",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"moeserve.loadtest.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'moeserve.loadtest' has no attribute {name!r}")
