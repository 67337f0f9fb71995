"""`moeserve plan`: the flags, and the run that turns them into a table (and JSON, and a plot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from moeserve.plan.hardware import GPUS


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="size a deployment: search EP/TP/P:D/batch layouts against SLOs with a cost model"
    )
    p.add_argument("--model", help="a checkpoint folder (its config.json) or a known model name (required)")
    p.add_argument("--gpus", type=int, help="GPUs to deploy on (required)")
    p.add_argument(
        "--cache-per-sequence",
        nargs="+",
        metavar="MODEL",
        help="only print these models' cache bytes per sequence at 1k, 32k, 128k and 1M tokens, side by side "
        "(from their layers' cache specs), and each saved state's of prefix caching",
    )
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU kind (default: h100)")
    p.add_argument("--nodes", type=int, default=None, help="nodes the GPUs span (default: full NVLink domains)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="time to first token target (default: 2000)")
    p.add_argument("--slo-tbt-ms", type=float, default=100.0, help="time between tokens target (default: 100)")
    p.add_argument("--isl", type=int, default=1024, help="input tokens per request (default: 1024)")
    p.add_argument("--osl", type=int, default=1024, help="output tokens per request (default: 1024)")
    p.add_argument(
        "--rate", type=float, default=None, help="requests/s offered (default: 90%% of each layout's capacity)"
    )
    p.add_argument("--mtp", type=int, default=0, help="MTP draft tokens per step (default: 0)")
    p.add_argument("--mtp-acceptance", type=float, default=0.0, help="acceptance rate of each draft (default: 0)")
    p.add_argument("--expert-imbalance", type=float, default=1.2, help="max/mean expert rows per rank (default: 1.2)")
    p.add_argument("--num-comm-sms", type=int, default=20, help="SMs communication takes under TBO (default: 20)")
    p.add_argument("--no-disaggregate", action="store_true", help="colocated layouts only (no prefill/decode split)")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default: 5)")
    p.add_argument("--calibrate", type=Path, nargs="+", default=[], help="measured results replacing assumed figures")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--plot", type=Path, default=None, help="write the throughput/latency frontier as a PNG here")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    from moeserve.plan import report
    from moeserve.plan.calibrate import calibrate
    from moeserve.plan.hardware import Hardware
    from moeserve.plan.search import SearchSpace, screen, search
    from moeserve.plan.serving import Workload
    from moeserve.plan.shapes import load_config, load_shape

    if args.cache_per_sequence:
        from moeserve.plan.cache import cache_table, sequence_cache

        print(cache_table([sequence_cache(*load_config(model)) for model in args.cache_per_sequence]))
        return 0
    if args.model is None or args.gpus is None:
        raise ValueError("--model and --gpus are required (unless --cache-per-sequence)")
    started = time.monotonic()
    if args.gpus < 1 or args.isl < 1 or args.osl < 1:
        raise ValueError("--gpus, --isl and --osl must be >= 1")
    if not 0 <= args.mtp_acceptance <= 1 or args.mtp < 0:
        raise ValueError("--mtp must be >= 0 and --mtp-acceptance in [0, 1]")
    shape = load_shape(args.model)
    hw = calibrate(Hardware.of(args.gpu), args.calibrate, shape)
    nodes = args.nodes or max(1, math.ceil(args.gpus / hw.gpu.nvlink_domain))
    if args.gpus % nodes:
        raise ValueError(f"--gpus {args.gpus} cannot be spread evenly over --nodes {nodes}")
    # fewer GPUs a node than the GPU's NVLink domain: the node is the domain
    domain = min(hw.gpu.nvlink_domain, args.gpus // nodes)
    hw = dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, nvlink_domain=domain))
    space = SearchSpace(
        gpus=args.gpus,
        nodes=nodes,
        disaggregate=not args.no_disaggregate,
        num_comm_sms=args.num_comm_sms,
        expert_imbalance=args.expert_imbalance,
    )
    workload = Workload(
        isl=args.isl, osl=args.osl, rate=args.rate, mtp_drafts=args.mtp, mtp_acceptance=args.mtp_acceptance
    )
    ttft, tbt = args.slo_ttft_ms / 1e3, args.slo_tbt_ms / 1e3
    results = search(shape, hw, space, workload, ttft, tbt)[: args.top]
    if args.plot is not None:
        report.plot(screen(shape, hw, space, workload, math.inf), results, args.plot)
    if args.json:
        print(json.dumps(report.document(shape.name, hw, workload, ttft, tbt, results), indent=1))
        return 0
    print(
        f"{shape.name} on {args.gpus} x {hw.gpu.name} ({nodes} node{'s' * (nodes > 1)}), isl {args.isl} osl "
        f"{args.osl}, SLO TTFT {args.slo_ttft_ms:g} ms TBT {args.slo_tbt_ms:g} ms"
    )
    if not results:
        print("no layout fits in memory and meets the TBT target at any batch cap")
    else:
        print(report.table(results))
    print(report.provenance_line(hw))
    if args.plot is not None:
        print(f"frontier plot: {args.plot}")
    print(f"planned in {time.monotonic() - started:.1f} s")
    return 0
