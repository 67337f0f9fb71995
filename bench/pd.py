"""Prefill/decode disaggregation against colocation on this machine's two cores, side by side.

Two deployments of one model, both up for the whole run: a colocated instance at --ep 2 (both
cores), and a prefill instance on core 0 with a decode instance on core 1 behind `moeserve
router`. The same seeded load goes to each in turn, alternating which goes first, for --rounds
rounds (`moeserve bench serve`, open loop): long prompts with short outputs mixed with short
prompts and long outputs. On two cores the colocated instance has twice the compute for either
phase, so it may well win; what disaggregation shows here is that the decode instance's steps
carry no prefill chunks: its step-time distribution stays narrow while the colocated one's has
the long steps that stall every stream (TBT).

    python bench/pd.py [--rounds 3] [--num-prompts 12] [--request-rate 0.5]

Writes bench/results/pd.json: per deployment, TTFT and TBT percentiles over every round's
requests, goodput and SLO attainment under --ttft-ms/--tbt-ms, and the engine step-time
histograms (the decode instance's, the colocated instance's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moeserve.checkpoints import MakeModelSpec, make_model

RESULTS = Path(__file__).parent / "results"
SPEC = MakeModelSpec(
    arch="qwen3_moe",
    layers=2,
    hidden=256,
    experts=8,
    top_k=2,
    vocab=512,
    heads=4,
    kv_heads=2,
    head_dim=64,
    moe_intermediate=512,
    dtype="float32",
    max_position_embeddings=2048,
)
COMMON = ("--max-model-len", "1024", "--block-size", "16", "--kv-cache-memory", "64MiB", "--max-num-seqs", "16")
LISTENING = re.compile(r"(?:Uvicorn running on|listening on) (http://[\d.]+:\d+)")
STEP_METRIC = "moeserve:engine_step_duration_seconds"


def _start(args: list[str], log: Path, cpus: str | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "moeserve", *args]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _url(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = LISTENING.search(log.read_text())
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{log} exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{log} did not listen")


def _wait_healthy(url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy")


def _step_buckets(url: str) -> dict[float, float]:
    """Cumulative bucket counts of the engine step-time histogram (le -> count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == STEP_METRIC:
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return {}


def _step_histogram(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Steps per bucket (not cumulative) run between two snapshots; idle turns (a decode instance
    waiting on a transfer reports a 0 s step) fall in the first bucket and are dropped."""
    edges = sorted(after)
    counts, previous = {}, 0.0
    for edge in edges:
        cumulative = after[edge] - before.get(edge, 0.0)
        if edge != edges[0]:
            counts[f"le_{edge:g}s"] = cumulative - previous
        previous = cumulative
    return counts


def _dataset(path: Path, num_prompts: int, seed: int) -> None:
    """Alternating long prompts with short outputs and short prompts with long outputs."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_prompts):
        prompt_len, output_len = (640, 16) if i % 2 == 0 else (32, 128)
        lines.append(
            json.dumps({"prompt": [rng.randrange(10, 500) for _ in range(prompt_len)], "output_len": output_len})
        )
    path.write_text("\n".join(lines) + "\n")


def _bench(url: str, dataset: Path, args: argparse.Namespace, seed: int, out: Path) -> dict:
    command = [
        sys.executable, "-m", "moeserve", "bench", "serve", "--base-url", url, "--endpoint", "completions",
        "--dataset-name", "jsonl", "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.request_rate), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
        "--no-cross-check", "--goodput", f"ttft:{args.ttft_ms}", f"tbt:{args.tbt_ms}", "--save-result", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "count": len(ordered)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--request-rate", type=float, default=0.5)
    parser.add_argument("--ttft-ms", type=float, default=4000)
    parser.add_argument("--tbt-ms", type=float, default=400)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moeserve-pd-"))
    model = make_model(SPEC, work / "model")
    dataset = work / "load.jsonl"
    _dataset(dataset, args.num_prompts, seed=0)
    launch = ["launch", "--model", str(model), "--served-model-name", "pd", "--port", "0", *COMMON]
    disagg = ["--kv-transfer", "nixl", "--cpu-binding", "off"]
    procs = {
        "colocated": _start([*launch, "--ep", "2"], work / "colocated.log", None),
        "prefill": _start([*launch, "--role", "prefill", *disagg], work / "prefill.log", "0"),
        "decode": _start([*launch, "--role", "decode", *disagg], work / "decode.log", "1"),
    }
    try:
        urls = {name: _url(proc, work / f"{name}.log") for name, proc in procs.items()}
        for url in urls.values():
            _wait_healthy(url)
        router_args = ["router", "--prefill", urls["prefill"], "--decode", urls["decode"], "--port", "0"]
        procs["router"] = _start(router_args, work / "router.log", None)
        urls["disaggregated"] = _url(procs["router"], work / "router.log")
        runs: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
        steps_before = {"colocated": _step_buckets(urls["colocated"]), "decode": _step_buckets(urls["decode"])}
        for round_index in range(args.rounds):
            order = ["colocated", "disaggregated"] if round_index % 2 == 0 else ["disaggregated", "colocated"]
            for name in order:
                run = _bench(urls[name], dataset, args, round_index, work / f"{name}-{round_index}.json")
                runs[name].append(run)
                print(f"round {round_index + 1} {name}: goodput {run['goodput']:.3f} req/s", flush=True)
        steps = {
            "colocated": _step_histogram(steps_before["colocated"], _step_buckets(urls["colocated"])),
            "decode_instance": _step_histogram(steps_before["decode"], _step_buckets(urls["decode"])),
        }
        transfer = httpx.get(f"{urls['decode']}/metrics", timeout=10).text
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)

    summary = {}
    for name, rounds in runs.items():
        requests = [r for run in rounds for r in run["requests"] if r.get("ttft_ms") is not None]
        summary[name] = {
            "ttft_ms": _percentiles([r["ttft_ms"] for r in requests]),
            "tbt_ms": _percentiles([gap for r in requests for gap in r["tbt_ms"]]),
            "goodput_req_s": statistics.mean(run["goodput"] for run in rounds),
            "attainment": [run["attainment"] for run in rounds],
            "failed": sum(run["num_failed"] for run in rounds),
        }
    moved = [line for line in transfer.splitlines() if line.startswith("moeserve:kv_transfer_bytes_total")]
    document = {
        "bench": "pd",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": SPEC.__dict__,
        "load": {
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "mix": "alternating: 640-token prompt / 16 outputs, 32-token prompt / 128 outputs",
            "rounds": args.rounds,
            "slo_ms": {"ttft": args.ttft_ms, "tbt": args.tbt_ms},
        },
        "deployments": {
            "colocated": "one instance, --ep 2, both cores",
            "disaggregated": "prefill instance on core 0, decode instance on core 1, moeserve router",
        },
        "summary": summary,
        "engine_step_seconds": steps,
        "decode_kv_transfer_bytes": moved[0].split()[-1] if moved else None,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pd.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"\n{'deployment':<15}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p50':>9}{'TBT p99':>9}{'goodput':>9}")
    for name, s in summary.items():
        t, g = s["ttft_ms"], s["tbt_ms"]
        print(f"{name:<15}{t['p50']:>10.0f}{t['p99']:>10.0f}{g['p50']:>9.0f}{g['p99']:>9.0f}{s['goodput_req_s']:>9.3f}")
    print("\nengine steps per bucket (colocated | decode instance):")
    for bucket in steps["colocated"]:
        print(f"  {bucket:<12}{steps['colocated'][bucket]:>8.0f} | {steps['decode_instance'].get(bucket, 0):>8.0f}")
    print(f"\nwrote {RESULTS / 'pd.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
