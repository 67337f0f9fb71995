"""What n-gram drafting costs the scheduler's thread per step, at 1k and 32k tokens of context:
the incremental proposer it runs (`NgramProposer`) beside the backward scan it replaced
(`propose_ngram` over a fresh copy of the whole sequence, as the scheduler did until then).

Workload: `--requests` sequences decoding together, each with `context` random tokens over a
150k vocabulary (nothing repeats but by chance, prompt lookup's usual case on ordinary text,
where the scan reads the whole sequence for each n) and a random token appended per step. The
timed part of a step is what the scheduler does for drafting: for every sequence, the scan's copy
and search, or the proposer's read of the new token and its look-up; both run in this process on
the same sequences and tokens (the proposer's steps first, then the scan's), and must propose the
same drafts at every step. Also reported: the proposer's one-time read of each context (paid
chunk by chunk as a prompt's KV is computed) and the memory it keeps per token. The machine is
shared with other work: medians of per-step times (and the proposer's slowest step), and the
1-minute load average at the start and end.

    python bench/ngram_drafting.py [--contexts 1024 32768] [--requests 64] [--steps 32] [--k 3]

Writes bench/results/ngram_drafting.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from moeserve.spec_decode import NgramProposer, propose_ngram

RESULTS = Path(__file__).parent / "results"
VOCAB = 150_000
MIN_N, MAX_N = 1, 5  # the speculative_config defaults


def machine() -> str:
    """The CPU's model name and core count, and that others use it too."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
    ]
    model = names[0] if names else platform.machine()
    return f"CPU: {model}, {os.cpu_count()} cores, shared with other work; Python {platform.python_version()}"


def measure(context: int, requests: int, steps: int, k: int, rng: random.Random) -> dict:
    """Per-step drafting time of the scan and of the proposer over the same `requests` sequences
    and the same appended tokens: the proposer's steps first, then the scan's (run apart, so that
    neither finds its memory evicted by the other), their drafts compared step by step."""
    prompts = [[rng.randrange(VOCAB) for _ in range(context)] for _ in range(requests)]
    appended = [[rng.randrange(VOCAB) for _ in prompts] for _ in range(steps)]
    proposers = [NgramProposer(MIN_N, MAX_N) for _ in prompts]
    reads = []
    for proposer, prompt in zip(proposers, prompts):
        start = time.perf_counter()
        proposer.extend(prompt)
        reads.append(time.perf_counter() - start)
    proposer_s, proposed = [], []
    for tokens in appended:
        start = time.perf_counter()
        step = []
        for proposer, token in zip(proposers, tokens):
            proposer.extend((token,))
            step.append(proposer.propose(k))
        proposer_s.append(time.perf_counter() - start)
        proposed.append(step)
    del proposers
    scan_s = []
    for tokens, expected in zip(appended, proposed):
        for prompt, token in zip(prompts, tokens):
            prompt.append(token)
        start = time.perf_counter()
        # What the scheduler did: a fresh list of the whole sequence, then the scan over it.
        scanned = [propose_ngram(list(sequence), k, MIN_N, MAX_N) for sequence in prompts]
        scan_s.append(time.perf_counter() - start)
        assert scanned == expected, "the proposer and the scan disagree"
    scan_ms, proposer_ms = 1000 * statistics.median(scan_s), 1000 * statistics.median(proposer_s)
    return {
        "context_tokens": context,
        "requests": requests,
        "steps": steps,
        "scan_ms_per_step_median": scan_ms,
        "proposer_ms_per_step_median": proposer_ms,
        "proposer_ms_per_step_max": 1000 * max(proposer_s),
        "speedup": scan_ms / proposer_ms,
        "proposals_with_drafts": sum(map(bool, (drafts for step in proposed for drafts in step))),
        "proposals": steps * requests,
        "proposer_read_ms_per_request_median": 1000 * statistics.median(reads),
        "proposer_bytes_per_token": proposer_bytes_per_token(prompts[0][:context]),
    }


def proposer_bytes_per_token(tokens: list[int]) -> float:
    """What a proposer that has read `tokens` keeps, per token (the tokens' own int objects aside:
    the request holds those already)."""
    tracemalloc.start()
    proposer = NgramProposer(MIN_N, MAX_N)
    proposer.extend(tokens)
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del proposer
    return kept / len(tokens)


def table(rows: list[dict]) -> str:
    lines = [
        "| context | requests | scan ms/step | proposer ms/step (max) | speedup | proposer read ms/request (once) "
        "| proposer bytes/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context_tokens']} | {r['requests']} | {r['scan_ms_per_step_median']:.1f} | "
            f"{r['proposer_ms_per_step_median']:.2f} ({r['proposer_ms_per_step_max']:.2f}) | {r['speedup']:.0f}x | "
            f"{r['proposer_read_ms_per_request_median']:.1f} | {r['proposer_bytes_per_token']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    load_start = os.getloadavg()[0]
    rows = [measure(context, args.requests, args.steps, args.k, rng) for context in args.contexts]
    result = {
        "machine": machine(),
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "workload": (
            f"{args.requests} sequences of random tokens over a {VOCAB}-token vocabulary, one token appended "
            f"per step, k={args.k}, prompt_lookup {MIN_N}..{MAX_N}; median of {args.steps} steps"
        ),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ngram_drafting.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
