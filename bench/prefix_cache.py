"""What prefix caching buys when requests share a long prompt prefix, side by side.

32 requests share a 1,024-token prefix (a system prompt, a document under discussion) and differ
in a 64-token suffix; all arrive at once. Two engines in this process, one with
`--enable-prefix-caching` and one without, take turns over `--repeats` rounds, each round with a
fresh prefix (so the cached engine never starts warm). Per round: greedy outputs must be identical,
TTFT (the engine's, arrival to first token) is compared by its median, and the hit rate from the
engine's counters is compared with what the shared length allows: the first request computes the
prefix and the 31 others find it, (N - 1) / N * prefix / prompt.

    python bench/prefix_cache.py [--repeats 3] [--requests 32] [--prefix 1024] [--suffix 64]

Writes bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
from pathlib import Path

from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.engine import LLMEngine
from moeserve.engine.stats import IterationStats
from moeserve.engine_config import EngineConfig
from moeserve.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
# bench/slo_vs_fcfs.py's model: wide enough that a prompt token costs real compute on CPU.
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
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Counters:
    """The prefix cache counters, as /metrics adds them up."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0

    def record(self, stats: IterationStats) -> None:
        self.queries += stats.prefix_cache_queries
        self.hits += stats.prefix_cache_hits


def make_engine(model: Path, caching: bool, counters: Counters) -> LLMEngine:
    config = EngineConfig.from_options(
        model=str(model), max_model_len=2048, max_num_seqs=64, enable_prefix_caching=caching
    )
    return LLMEngine(config, stat_loggers=[counters])


def prompts(rng: random.Random, requests: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    prefix = [rng.randrange(5, SPEC.vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(5, SPEC.vocab) for _ in range(suffix_len)] for _ in range(requests)]


def run(engine: LLMEngine, batch: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """All of `batch` at once; (each request's tokens, each request's TTFT in seconds)."""
    ids = [engine.add_request(prompt, GREEDY) for prompt in batch]
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[i].outputs[0].token_ids for i in ids], [done[i].metrics.ttft_s for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix, tokens")
    parser.add_argument("--suffix", type=int, default=64, help="each request's own tokens after it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = make_model(SPEC, Path(tempfile.mkdtemp()) / "model")
    counters = {caching: Counters() for caching in (True, False)}
    engines = {caching: make_engine(model, caching, counters[caching]) for caching in (True, False)}
    rng = random.Random(args.seed)
    for engine in engines.values():  # warm-up, unmeasured: first-step allocations and caches
        run(engine, prompts(rng, 4, 256, 16))
    counters[True].queries = counters[True].hits = 0

    rounds = []
    for repeat in range(args.repeats):
        batch = prompts(rng, args.requests, args.prefix, args.suffix)
        order = (True, False) if repeat % 2 == 0 else (False, True)
        tokens, ttfts = {}, {}
        for caching in order:
            tokens[caching], ttfts[caching] = run(engines[caching], batch)
        medians = {caching: statistics.median(ttfts[caching]) for caching in (True, False)}
        rounds.append(
            {
                "first": "cached" if order[0] else "uncached",
                "outputs_identical": tokens[True] == tokens[False],
                "ttft_median_ms": {"cached": 1000 * medians[True], "uncached": 1000 * medians[False]},
                "ttft_median_ratio": medians[False] / medians[True],
            }
        )
        print(f"round {repeat}: {json.dumps(rounds[-1])}")

    block_size = engines[True].config.cache.block_size
    shared = args.prefix // block_size * block_size  # only full blocks are cached
    expected = (args.requests - 1) / args.requests * shared / (args.prefix + args.suffix)
    cached = counters[True]
    result = {
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": (
            f"random qwen3_moe, {SPEC.layers} layers, hidden {SPEC.hidden}, "
            f"{SPEC.experts} experts top-{SPEC.top_k}, float32"
        ),
        "load": (
            f"{args.requests} requests at once sharing a {args.prefix}-token prefix, {args.suffix} own tokens "
            f"each, {GREEDY.max_tokens} greedy tokens out; block size {block_size}, max_num_batched_tokens 8192"
        ),
        "repeats": args.repeats,
        "rounds": rounds,
        "outputs_identical": all(r["outputs_identical"] for r in rounds),
        "ttft_median_ratio": statistics.median(r["ttft_median_ratio"] for r in rounds),
        "hit_rate": cached.hits / cached.queries,
        "hit_rate_expected": expected,
        "prefix_cache_queries": cached.queries,
        "prefix_cache_hits": cached.hits,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
