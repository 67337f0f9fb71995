"""Per-request SLOs under a two-class load near the knee, and token-aware routing past a straggler.

Part 1 (one group): a seeded mix of a tight class (chat) and a loose one (batch), each request
carrying its class's targets, offered open loop near the knee of a tiny model whose steps are
padded to `--step-ms` (`--debug-min-step-time-ms`), so capacity is known and the CPU's own speed
matters little. Three set-ups, alternated over `--repeats` runs on the same arrivals: fcfs; slo
with admission `reject`; slo with admission `off`. Per class: requests sent, refused (429),
attainment of TTFT / TBT (every gap) / both over the requests sent and over those admitted, and
goodput (requests/s meeting both). Asserted: of the requests admission predicted to meet their
TTFT target, at least 95% did (the schedulers' `AdmissionTally`).

Part 2 (`--ep 4`, four data-parallel groups in four rank processes): the same kind of mix with
rank 3 straggling (`--debug-slow-rank 3:MS`, MS ms more per token its group computes), routed
by tokens (each group priced by its own measured step times) and by request count, alternated.
Per routing: prompt tokens placed in each group, mean step time, attainment per class.

Both run in this process on the engine directly (like bench/slo_vs_fcfs.py): the figures are the
engine's verdicts, each request judged by its own targets.

    python bench/request_slos.py [--seconds 12] [--repeats 3] [--rate 2.5] [--ep4-rate 8]

Writes bench/results/request_slos.json.
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

import request_slos_sim as sim

from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.engine import LLMEngine
from moeserve.engine.stats import IterationStats, RequestMetrics
from moeserve.engine_config import EngineConfig
from moeserve.loadtest.slo_mix import MixClass, assign_classes, parse_slo_mix
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import SLORejectedError
from moeserve.slo import RequestSLO, SLOClass

RESULTS = Path(__file__).parent / "results"
SPEC = MakeModelSpec(arch="qwen3_moe", layers=2, hidden=64, experts=8, vocab=512, max_position_embeddings=4096)
# Targets in steps of the padded step time (200 ms): chat's TTFT 15 steps, TBT 5. The machine is
# shared (a neighbour's burst can stall a step for 300 ms), so tighter targets would measure
# the neighbours' load rather than the scheduling.
MIX = "chat:0.7:ttft=3000,tbt=1000;batch:0.3:ttft=20000,tbt=2000"
# Part 2's chat TBT sits between a padded step (200 ms) and one where the straggler computes a
# full 128-token chunk (200 + 1.5 * 128 = 392 ms): what the straggler's prefill costs everyone.
EP4_MIX = "chat:0.7:ttft=3000,tbt=350;batch:0.3:ttft=20000,tbt=2000"
LENGTHS = {"chat": ((32, 96), (8, 24)), "batch": ((256, 512), (4, 8))}
"""Per class: (prompt tokens, output tokens) ranges."""
BUDGET = 128  # max_num_batched_tokens: a batch prompt takes 2-4 full steps
SETUPS = (("fcfs", "off"), ("slo", "reject"), ("slo", "off"))


@dataclass(frozen=True)
class Arrival:
    at_s: float
    cls: MixClass
    prompt: list[int]
    max_tokens: int


def workload(seconds: float, rate: float, mix: tuple[MixClass, ...], seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate`, each of a class drawn as `bench serve --slo-mix` draws it."""
    rng = random.Random(seed)
    times = []
    t = rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    arrivals = []
    for at_s, index in zip(times, assign_classes(len(times), mix, seed)):
        cls = mix[index]
        (p_lo, p_hi), (o_lo, o_hi) = LENGTHS[cls.name]
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(p_lo, p_hi))]
        arrivals.append(Arrival(at_s, cls, prompt, rng.randint(o_lo, o_hi)))
    return arrivals


class StepTimes:
    """Keeps every step's duration."""

    def __init__(self) -> None:
        self.durations: list[float] = []

    def record(self, stats: IterationStats) -> None:
        if stats.step_duration_s is not None:
            self.durations.append(stats.step_duration_s)


def make_engine(model: Path, mix: tuple[MixClass, ...], steps: StepTimes, step_ms: float, **options) -> LLMEngine:
    config = EngineConfig.from_options(
        model=str(model),
        max_model_len=2048,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=64,
        kv_cache_memory=256 * 1024**2,
        min_step_time_ms=step_ms,
        slo_class=tuple(SLOClass(c.name, c.ttft_s, c.tbt_s) for c in mix),
        dtype="float32",
        **options,
    )
    return LLMEngine(config, stat_loggers=[steps])


def warm_process(model: Path, mix: tuple[MixClass, ...], **options) -> None:
    """A throwaway engine's warm-up: the process's first steps of each shape cost up to a second
    (allocator and kernel set-up), which no measured engine should learn from."""
    engine = make_engine(model, mix, StepTimes(), 0.0, **options)
    warm_up(engine)
    engine.shutdown()


def warm_up(engine: LLMEngine) -> None:
    """Unmeasured: a few streams and a long prompt, so the step-time models (chunk sizing,
    admission, routing) have seen decodes and prefill before the load, as a running server has."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request([5 + i] * 48, params)
    engine.add_request([7] * 900, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@dataclass
class RunRecord:
    classes: dict[str, str]
    """request id -> class name, for every admitted request."""
    rejected: dict[str, int]
    finished: dict[str, RequestMetrics]
    placed_tokens: list[int]
    """Prompt tokens placed in each data-parallel group."""


def run(engine: LLMEngine, arrivals: list[Arrival]) -> RunRecord:
    record = RunRecord({}, {}, {}, [0] * len(engine.scheduler.groups))
    start = time.monotonic()
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].at_s <= now:
            a = pending.pop(0)
            slo = RequestSLO(a.cls.ttft_s, a.cls.tbt_s, a.cls.name)
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True, slo=slo)
            try:
                request_id = engine.add_request(a.prompt, params, arrival_time=start + a.at_s)
            except SLORejectedError:
                record.rejected[a.cls.name] = record.rejected.get(a.cls.name, 0) + 1
                continue
            record.classes[request_id] = a.cls.name
            record.placed_tokens[engine.scheduler.group_of(request_id)] += len(a.prompt)
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(max(0.0, pending[0].at_s - (time.monotonic() - start)))
            continue
        for output in engine.step():
            if output.finished:
                record.finished[output.request_id] = output.metrics
    return record


def summarize(record: RunRecord, mix: tuple[MixClass, ...], seconds: float) -> dict:
    summary: dict = {}
    for cls in mix:
        done = [m for rid, m in record.finished.items() if record.classes[rid] == cls.name]
        rejected = record.rejected.get(cls.name, 0)
        sent = len(done) + rejected
        both = sum(m.ttft_met and m.tbt_met for m in done)
        summary[cls.name] = {
            "sent": sent,
            "rejected": rejected,
            "attainment": {
                "ttft": sum(m.ttft_met for m in done) / sent,
                "tbt": sum(m.tbt_met for m in done) / sent,
                "both": both / sent,
            },
            "admitted_attainment_both": both / len(done) if done else None,
            "goodput_per_s": both / seconds,
        }
    everyone = list(record.finished.values())
    sent = len(everyone) + sum(record.rejected.values())
    summary["all_both_attained"] = sum(m.ttft_met and m.tbt_met for m in everyone) / sent
    return summary


def mean_of_runs(runs: list[dict]) -> dict:
    """Field-wise mean of summaries of one shape (None where any run has None)."""
    first = runs[0]
    out = {}
    for k, v in first.items():
        values = [r[k] for r in runs]
        if isinstance(v, dict):
            out[k] = mean_of_runs(values)
        elif isinstance(v, list):
            out[k] = [statistics.fmean(col) for col in zip(*values)]
        else:
            out[k] = None if any(x is None for x in values) else statistics.fmean(values)
    return out


def step_stats(steps: StepTimes) -> dict[str, float]:
    """Mean, p99 and max step time in ms: how far the shared machine stretched the padded step."""
    ordered = sorted(steps.durations)
    return {
        "mean": 1000 * statistics.fmean(ordered),
        "p99": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": 1000 * ordered[-1],
    }


def tally(engine: LLMEngine) -> dict[str, int]:
    t = engine.scheduler.admission
    return {"predicted_on_time": t.predicted_on_time, "on_time": t.on_time, "rejected": t.rejected}


def part_slo_policies(model: Path, args: argparse.Namespace, mix: tuple[MixClass, ...]) -> dict:
    arrivals = workload(args.seconds, args.rate, mix, args.seed)
    warm_process(model, mix)
    runs: dict[str, list[dict]] = {f"{p}+admission_{a}": [] for p, a in SETUPS}
    predictions = {"predicted_on_time": 0, "on_time": 0, "rejected": 0}
    for repeat in range(args.repeats):
        for policy, admission in SETUPS:
            steps = StepTimes()
            engine = make_engine(model, mix, steps, args.step_ms, scheduling_policy=policy, slo_admission=admission)
            warm_up(engine)
            before = tally(engine)
            steps.durations.clear()
            summary = summarize(run(engine, arrivals), mix, args.seconds)
            summary["step_ms"] = step_stats(steps)
            after = tally(engine)
            for k in predictions:
                predictions[k] += after[k] - before[k]
            engine.shutdown()
            runs[f"{policy}+admission_{admission}"].append(summary)
            print(f"run {repeat} {policy} admission={admission}: {json.dumps(summary)}", flush=True)
    kept = predictions["on_time"] / predictions["predicted_on_time"] if predictions["predicted_on_time"] else None
    return {
        "load": {
            "seconds": args.seconds,
            "rate_per_s": args.rate,
            "requests": len(arrivals),
            "by_class": {c.name: sum(a.cls is c for a in arrivals) for c in mix},
        },
        "policies": {name: mean_of_runs(summaries) for name, summaries in runs.items()},
        "admission_predictions": {**predictions, "kept_fraction": kept},
    }


def part_simulated(args: argparse.Namespace, mix: tuple[MixClass, ...]) -> dict:
    """The three set-ups on the same arrivals, the scheduler alone on a simulated clock, at each
    of `--sim-rates` over `--sim-seconds` (cheap: no model runs)."""
    by_rate, predictions = {}, {"predicted_on_time": 0, "on_time": 0, "rejected": 0}
    for rate in args.sim_rates:
        arrivals = workload(args.sim_seconds, rate, mix, args.seed)
        policies = {}
        for policy, admission in SETUPS:
            by_class, tally = sim.simulate(arrivals, policy, admission, BUDGET)
            policies[f"{policy}+admission_{admission}"] = sim.summarize(by_class, args.sim_seconds)
            for k in predictions:
                predictions[k] += tally[k]
        by_rate[f"{rate:g}/s"] = {"requests": len(arrivals), "policies": policies}
    kept = predictions["on_time"] / predictions["predicted_on_time"] if predictions["predicted_on_time"] else None
    return {
        "step_cost": f"{1000 * sim.STEP_FLOOR_S:g} ms + {1000 * sim.PER_TOKEN_S:g} ms per token",
        "seconds": args.sim_seconds,
        "by_rate": by_rate,
        "admission_predictions": {**predictions, "kept_fraction": kept},
    }


def part_straggler(model: Path, args: argparse.Namespace, mix: tuple[MixClass, ...]) -> dict:
    arrivals = workload(args.seconds, args.ep4_rate, mix, args.seed + 1)
    warm_process(model, mix, ep=4)
    runs: dict[str, list[dict]] = {"tokens": [], "requests": []}
    for repeat in range(args.repeats):
        for routing in ("tokens", "requests"):
            steps = StepTimes()
            engine = make_engine(
                model, mix, steps, args.step_ms, ep=4, dp_routing=routing, debug_slow_rank=f"3:{args.slow_ms}"
            )
            warm_up(engine)
            steps.durations.clear()
            record = run(engine, arrivals)
            engine.shutdown()
            summary = summarize(record, mix, args.seconds)
            summary["placed_prompt_tokens"] = record.placed_tokens
            summary["step_ms"] = step_stats(steps)
            runs[routing].append(summary)
            print(f"run {repeat} ep4 routing={routing}: {json.dumps(summary)}", flush=True)
    return {
        "load": {"seconds": args.seconds, "rate_per_s": args.ep4_rate, "requests": len(arrivals)},
        "slow_rank": {"rank": 3, "ms_per_token": args.slow_ms},
        "routing": {name: mean_of_runs(summaries) for name, summaries in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each run's arrival window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2.5, help="requests/s of part 1")
    parser.add_argument("--ep4-rate", type=float, default=8.0, help="requests/s of part 2")
    parser.add_argument("--step-ms", type=float, default=200.0, help="--debug-min-step-time-ms")
    parser.add_argument("--slow-ms", type=float, default=1.5, help="rank 3's extra ms per token of its group")
    parser.add_argument("--mix", default=MIX)
    parser.add_argument("--ep4-mix", default=EP4_MIX)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-seconds", type=float, default=120.0, help="arrival window of the simulated part")
    parser.add_argument(
        "--sim-rates",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[2.8, 3.5],
        help="requests/s of the simulated part: near its knee (~2.9/s) and past it",
    )
    parser.add_argument(
        "--parts",
        default="sim,engine,ep4",
        help="which parts to run (sim, engine, ep4); the others keep their figures in the results file",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"sim", "engine", "ep4"}:
        parser.error(f"--parts takes a comma list of sim, engine, ep4; got {args.parts!r}")

    mix, ep4_mix = parse_slo_mix(args.mix), parse_slo_mix(args.ep4_mix)
    path = RESULTS / "request_slos.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update(
        {
            "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "model": f"random qwen3_moe, {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.experts} experts, float32",
            "mix": args.mix,
            "lengths": {name: {"prompt": p, "output": o} for name, (p, o) in LENGTHS.items()},
            "step_ms_floor": args.step_ms,
            "max_num_batched_tokens": BUDGET,
            "repeats": args.repeats,
            "load_average_1m_at_start": round(os.getloadavg()[0], 2),
            "note": "wall-clock parts measure the machine's other load too: step_ms against step_ms_floor shows it",
        }
    )
    if "sim" in parts:
        result["slo_policies_simulated"] = part_simulated(args, mix)
    model = make_model(SPEC, Path(tempfile.mkdtemp()) / "model") if parts & {"engine", "ep4"} else None
    if "engine" in parts:
        result["slo_policies"] = part_slo_policies(model, args, mix)
    if "ep4" in parts:
        result["ep4_straggler"] = {"mix": args.ep4_mix, **part_straggler(model, args, ep4_mix)}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    predictions = result["slo_policies_simulated"]["admission_predictions"]
    kept = predictions["kept_fraction"]
    assert kept is not None and kept >= 0.95, f"of requests predicted to meet TTFT only {kept} did ({predictions})"


if __name__ == "__main__":
    main()
