"""`moeserve bench serve`: the flags (vLLM's `vllm bench serve` names where they exist) and the run.

`add_bench_parser(subparsers)` hangs `bench serve` under the `moeserve` command;
`python -m moeserve.loadtest.cli serve ...` runs the same thing on its own. Building the parser
imports nothing heavy: the HTTP client, numpy and matplotlib load only when a benchmark runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moeserve.loadtest.metrics import OBJECTIVE_KINDS

if TYPE_CHECKING:
    from moeserve.loadtest.runner import RunReport
    from moeserve.loadtest.serve import BenchConfig

logger = logging.getLogger("moeserve.loadtest")


def _objective(text: str) -> tuple[str, float]:
    """'ttft:500' -> ("ttft", 0.5): a kind and a target in ms, returned in seconds."""
    kind, sep, value = text.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in OBJECTIVE_KINDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KIND:MS with KIND one of {', '.join(OBJECTIVE_KINDS)}, e.g. ttft:500"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of milliseconds") from None
    if not 0 < ms < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: the target must be a positive number of milliseconds")
    return kind, ms / 1000.0


def _rate(text: str) -> float:
    """A request rate: a positive number, or inf (everything at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a request rate: {text!r} (a positive number or inf)") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be positive, got {text!r}")
    return rate


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(_rate(part) for part in text.split(",") if part.strip())
    if not rates or any(math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite rates, e.g. 1,2,4,8; got {text!r}")
    return rates


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.99; got {text!r}")
    return value


def _slo_mix(text: str) -> tuple:
    from moeserve.loadtest.slo_mix import parse_slo_mix

    try:
        return parse_slo_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server: latency, goodput, SLO attainment",
        description="Send a bounded, open-loop load to an OpenAI-compatible server and measure TTFT, every TBT gap, "
        "TPOT and E2E latency from the client; report goodput and SLO attainment, sweep rates or search for the "
        "highest rate that meets the SLOs. See docs/bench-serve.md.",
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root (default: %(default)s); /v1/... and /metrics hang off it",
    )
    p.add_argument("--model", help="model id to request (default: the first one /v1/models lists)")
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )

    data = p.add_argument_group("prompts")
    data.add_argument("--dataset-name", choices=("random", "jsonl", "sharegpt"), default="random")
    data.add_argument(
        "--dataset-path", help='file for jsonl ({"prompt": text or [ids], "output_len": N} per line) or sharegpt'
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="requests per run (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    data.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="max_tokens; also for jsonl lines without output_len (default: %(default)s)",
    )
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default: %(default)s)",
    )
    data.add_argument(
        "--random-vocab-size",
        type=int,
        default=300,
        help="random prompt token ids are drawn from [10, this) (default: %(default)s)",
    )
    data.add_argument(
        "--tokenizer",
        help="Hugging Face tokenizer to count tokens when the server sends no usage, and for sharegpt lengths",
    )
    data.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS (vLLM extension), so every request generates max_tokens",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=_rate, default=None, help="requests/s, or inf to send all at once (default: inf)"
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 = Poisson, larger = more regular",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight; due requests wait for a slot"
    )
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals (default: %(default)s)")
    load.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a request may take in all before it is cancelled (default: %(default)s)",
    )
    load.add_argument(
        "--duration",
        type=float,
        default=3600.0,
        help="seconds after which a run sends nothing more (default: %(default)s)",
    )
    load.add_argument(
        "--warmup-requests", type=int, default=0, help="requests sent one at a time before measuring (default: 0)"
    )

    slo = p.add_argument_group("SLOs and rate search")
    slo.add_argument(
        "--goodput",
        nargs="+",
        type=_objective,
        metavar="KIND:MS",
        help="objectives a request must meet to count as good: ttft, tbt (EVERY gap between tokens), tpot, e2el",
    )
    rates = slo.add_mutually_exclusive_group()
    rates.add_argument("--sweep-rates", type=_rates, help="one run per rate, e.g. 1,2,4,8")
    rates.add_argument(
        "--find-max-goodput-rate",
        action="store_true",
        help="search for the highest rate whose attainment (all objectives) >= --slo-attainment",
    )
    slo.add_argument(
        "--slo-attainment", type=_fraction, default=0.99, help="attainment target for the search (default: %(default)s)"
    )
    slo.add_argument(
        "--search-start-rate", type=_rate, default=1.0, help="first rate the search probes (default: %(default)s)"
    )
    slo.add_argument(
        "--search-tolerance",
        type=float,
        default=0.05,
        help="stop when the knee is bracketed within this fraction (default: %(default)s)",
    )
    slo.add_argument(
        "--search-max-probes", type=int, default=16, help="most runs a search makes (default: %(default)s)"
    )
    slo.add_argument(
        "--slo-mix",
        type=_slo_mix,
        metavar="SPEC",
        help="a mix of SLO classes, NAME:WEIGHT:ttft=MS,tbt=MS;... e.g. chat:0.7:ttft=500,tbt=50;batch:0.3:ttft=20000,"
        "tbt=200: each request carries its class's targets in its slo field, and goodput and attainment are "
        "reported per class, client side and from the server's per-class counters",
    )
    slo.add_argument(
        "--no-cross-check",
        action="store_true",
        help="do not read the server's /metrics SLO counters before and after each run",
    )

    out = p.add_argument_group("output")
    out.add_argument("--save-result", type=Path, help="write the JSON result here (schema: docs/bench-serve.md)")
    out.add_argument(
        "--plot", type=Path, help="write PNG plots here: latency CDFs, and metrics against rate for sweeps and searches"
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_serve, bench_serve_parser=p)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` (with its `serve` sub-command) to a command's sub-parsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: `bench serve` load-tests a running server")
    _add_serve(bench.add_subparsers(dest="bench_command", required=True, metavar="{serve}"))
    return bench


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The benchmark the flags describe; ValueError for combinations argparse cannot check."""
    from moeserve.loadtest.metrics import Objectives
    from moeserve.loadtest.serve import BenchConfig

    if args.request_rate is not None and (args.sweep_rates or args.find_max_goodput_rate):
        raise ValueError(
            "--request-rate is for a single run; a sweep takes --sweep-rates, a search starts at --search-start-rate"
        )
    objectives = dict(args.goodput or ())
    if len(objectives) != len(args.goodput or ()):
        raise ValueError("--goodput names an objective twice")
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_vocab_size=args.random_vocab_size,
        tokenizer=args.tokenizer,
        request_rate=math.inf if args.request_rate is None else args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        objectives=Objectives(**objectives),
        sweep_rates=args.sweep_rates or (),
        find_max_goodput_rate=args.find_max_goodput_rate,
        slo_attainment=args.slo_attainment,
        search_start_rate=args.search_start_rate,
        search_tolerance=args.search_tolerance,
        search_max_probes=args.search_max_probes,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        api_key=args.api_key,
        timeout_s=args.timeout,
        duration_s=args.duration,
        warmup_requests=args.warmup_requests,
        cross_check=not args.no_cross_check,
        progress=not args.disable_tqdm,
        slo_mix=args.slo_mix or (),
    )


def _progress_line(report: RunReport) -> None:
    s = report.summary
    attained = f", attainment {100 * s.attainment['all']:.1f}%, goodput {s.goodput:.2f} req/s" if s.attainment else ""
    rate = "inf" if math.isinf(report.request_rate) else f"{report.request_rate:.4g} req/s"
    print(f"run at {rate}: {s.num_completed}/{s.num_sent} completed{attained}", file=sys.stderr)


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `bench serve` command: 0 when any request completed, 1 when none did."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        args.bench_serve_parser.error(str(e))
    from moeserve.loadtest.report import plot, rate_table, run_table
    from moeserve.loadtest.serve import bench_serve

    result = asyncio.run(bench_serve(config, on_run=_progress_line if config.mode != "single" else None))
    if config.mode == "single":
        print(run_table(result.reports[0], config.objectives))
    else:
        print(rate_table(result.reports, result.search))
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result.document, indent=2) + "\n")
        logger.info("wrote %s", args.save_result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        target = config.slo_attainment if config.mode == "search" else None
        plot(args.plot, result.reports, config.objectives, result.search, target)
        logger.info("wrote %s", args.plot)
    if not any(r.summary.num_completed for r in result.reports):
        logger.error("no request completed; see the errors above")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`moeserve bench` on its own (for `python -m moeserve.loadtest.cli serve ...`)."""
    parser = argparse.ArgumentParser(prog="moeserve bench", description="moeserve benchmarks")
    _add_serve(parser.add_subparsers(dest="bench_command", required=True, metavar="{serve}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:  # bad input found while running (a dataset file, no model): one line
        logger.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
