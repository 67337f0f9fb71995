"""What the `slo` scheduling policy buys over `fcfs` under a mixed load, side by side.

The load (seeded, open loop, the same for both policies): chat-like streams (short prompts, long
outputs) arrive as a Poisson process, and long documents (1-2k token prompts, short outputs)
arrive among them. Under fcfs a long prompt fills a whole step's token budget, so every running
stream waits that long for its next token; slo sizes prefill chunks from measured step times to
keep decode steps within the TBT target. Both run in this process on the engine directly, so the
numbers are the scheduler's, not HTTP's; policies alternate over `--repeats` runs.

    python bench/slo_vs_fcfs.py [--seconds 20] [--repeats 2] [--tbt-ms X] [--ttft-ms 3000]

Writes bench/results/slo_vs_fcfs.json: per policy and request class, TBT and TTFT percentiles
(engine-side, every gap) and SLO attainment (requests whose TTFT met the target, whose every
gap met the TBT target, and both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.engine import LLMEngine
from moeserve.engine.stats import IterationStats, RequestMetrics
from moeserve.engine_config import EngineConfig
from moeserve.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
# Wide enough that a token costs real compute: on CPU a narrow model's step time is all
# per-sequence overhead, and a long prompt would cost no more than a decode step.
SPEC = MakeModelSpec(
    arch="qwen3_moe",
    layers=4,
    hidden=512,
    experts=8,
    top_k=2,
    vocab=512,
    heads=8,
    kv_heads=2,
    head_dim=64,
    moe_intermediate=768,
    dtype="float32",
    max_position_embeddings=4096,
)
MAX_MODEL_LEN = 2304
BUDGET = 2048  # max_num_batched_tokens: a whole long prompt fits one fcfs step


@dataclass(frozen=True)
class Arrival:
    at_s: float
    kind: str  # "stream" or "document"
    prompt: list[int]
    max_tokens: int


def workload(seconds: float, stream_rate: float, document_rate: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = []
    for kind, rate in (("stream", stream_rate), ("document", document_rate)):
        t = rng.expovariate(rate)
        while t < seconds:
            if kind == "stream":
                prompt_len, max_tokens = rng.randint(24, 64), rng.randint(64, 160)
            else:
                prompt_len, max_tokens = rng.randint(1024, 2048), rng.randint(8, 16)
            arrivals.append(Arrival(t, kind, [rng.randrange(5, 500) for _ in range(prompt_len)], max_tokens))
            t += rng.expovariate(rate)
    return sorted(arrivals, key=lambda a: a.at_s)


class Recorder:
    """Keeps every TBT gap the engine reports."""

    def __init__(self) -> None:
        self.tbts: list[float] = []
        self.steps: list[tuple[int, float]] = []

    def record(self, stats: IterationStats) -> None:
        self.tbts.extend(stats.tbts_s)
        if stats.step_duration_s is not None:
            self.steps.append((stats.num_generation_tokens, stats.step_duration_s))


def make_engine(model: Path, policy: str, ttft_ms: float, tbt_ms: float, recorder: Recorder) -> LLMEngine:
    config = EngineConfig.from_options(
        model=str(model),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=128,
        scheduling_policy=policy,
        slo_ttft_ms=ttft_ms,
        slo_tbt_ms=tbt_ms,
        kv_cache_memory=1024**3,
    )
    return LLMEngine(config, stat_loggers=[recorder])


def calibrate_decode_step(model: Path, batch: int) -> float:
    """Median step time of `batch` sequences decoding together (nothing prefilling)."""
    recorder = Recorder()
    engine = make_engine(model, "fcfs", 1000.0, 1000.0, recorder)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + i, 6, 7, 8] * 8, params)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(d for n, d in recorder.steps[4:] if n == batch)


def warm_up(engine: LLMEngine) -> None:
    """A few streams and one long prompt, unmeasured: the same start for both policies, and slo's
    step-time model has seen prefill chunks before the load begins (as a running server has)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request([5 + i] * 32, params)
    for _ in range(20):
        engine.step()
    engine.add_request([7] * 1024, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run(
    model: Path, policy: str, arrivals: list[Arrival], ttft_ms: float, tbt_ms: float
) -> tuple[dict[str, RequestMetrics], Recorder, dict[str, str]]:
    recorder = Recorder()
    engine = make_engine(model, policy, ttft_ms, tbt_ms, recorder)
    warm_up(engine)
    recorder.tbts.clear()
    kinds: dict[str, str] = {}
    finished: dict[str, RequestMetrics] = {}
    start = time.monotonic()
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].at_s <= now:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
            request_id = engine.add_request(arrival.prompt, params, arrival_time=start + arrival.at_s)
            kinds[request_id] = arrival.kind
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at_s - (time.monotonic() - start)))
            continue
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.metrics
    return finished, recorder, kinds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(finished: dict[str, RequestMetrics], recorder: Recorder, kinds: dict[str, str]) -> dict:
    summary: dict = {
        "tbt_p50_ms": 1000 * percentile(recorder.tbts, 0.5),
        "tbt_p99_ms": 1000 * percentile(recorder.tbts, 0.99),
    }
    for kind in ("stream", "document"):
        metrics = [m for rid, m in finished.items() if kinds[rid] == kind]
        ttfts = [m.ttft_s for m in metrics if m.ttft_s is not None]
        summary[kind] = {
            "requests": len(metrics),
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
            "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
            "max_tbt_p50_ms": 1000
            * percentile([m.max_tbt_s for m in metrics if m.max_tbt_s is not None] or [0.0], 0.5),
            "ttft_attained": sum(m.ttft_met for m in metrics) / len(metrics),
            "tbt_attained": sum(m.tbt_met for m in metrics) / len(metrics),
            "both_attained": sum(m.ttft_met and m.tbt_met for m in metrics) / len(metrics),
        }
    everyone = list(finished.values())
    summary["all_both_attained"] = sum(m.ttft_met and m.tbt_met for m in everyone) / len(everyone)
    return summary


def mean_of_runs(runs: list[dict]) -> dict:
    """Field-wise mean of summaries with the same shape."""
    first = runs[0]
    return {
        k: mean_of_runs([r[k] for r in runs]) if isinstance(v, dict) else statistics.fmean(r[k] for r in runs)
        for k, v in first.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the arrival window")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stream-rate", type=float, default=2.0, help="chat streams per second")
    parser.add_argument("--document-rate", type=float, default=0.4, help="long prompts per second")
    parser.add_argument("--ttft-ms", type=float, default=3000.0)
    parser.add_argument("--tbt-ms", type=float, default=None, help="default: 2.5 x the measured step of 16 decodes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = make_model(SPEC, Path(tempfile.mkdtemp()) / "model")
    decode_step = calibrate_decode_step(model, 16)
    tbt_ms = args.tbt_ms or 2.5 * 1000 * decode_step
    arrivals = workload(args.seconds, args.stream_rate, args.document_rate, args.seed)
    print(
        f"decode step (16 seqs) {1000 * decode_step:.1f} ms; TBT target {tbt_ms:.1f} ms, TTFT target "
        f"{args.ttft_ms:.0f} ms; "
        f"{sum(a.kind == 'stream' for a in arrivals)} streams, {sum(a.kind == 'document' for a in arrivals)} documents"
    )

    by_policy: dict[str, list[dict]] = {"fcfs": [], "slo": []}
    for repeat in range(args.repeats):
        for policy in ("fcfs", "slo"):
            summary = summarize(*run(model, policy, arrivals, args.ttft_ms, tbt_ms))
            by_policy[policy].append(summary)
            print(f"run {repeat} {policy}: {json.dumps(summary)}")

    result = {
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": (
            f"random qwen3_moe, {SPEC.layers} layers, hidden {SPEC.hidden}, "
            f"{SPEC.experts} experts top-{SPEC.top_k}, float32"
        ),
        "load": {
            "seconds": args.seconds,
            "stream_rate_per_s": args.stream_rate,
            "document_rate_per_s": args.document_rate,
            "streams": "prompt 24-64, output 64-160 tokens",
            "documents": "prompt 1024-2048, output 8-16 tokens",
            "max_num_batched_tokens": BUDGET,
        },
        "decode_step_16_ms": 1000 * decode_step,
        "targets_ms": {"ttft": args.ttft_ms, "tbt": tbt_ms},
        "repeats": args.repeats,
        "fcfs": mean_of_runs(by_policy["fcfs"]),
        "slo": mean_of_runs(by_policy["slo"]),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "slo_vs_fcfs.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
