"""What serving costs per token: 64 streaming clients' time between tokens vs the bare model step.

Baseline (this process): the engine alone steps a batch of 64 decoding sequences; the median
time of a step where all 64 decode is the floor any server could reach for that batch.
Measured: `moeserve launch` on the same model in a child process, 64 concurrent streaming
clients (raw HTTP, this process). Per stream, TBT is (last token time - first token time) /
(tokens - 1) as the client sees it; the overhead is median client TBT / baseline step - 1.
The server's own view (/metrics: step time and engine-side TBT) tells whether the overhead is in
the step (the engine thread slowed by the HTTP side) or in delivery.

    python bench/serve_tbt_overhead.py [--model DIR] [--streams 64] [--tokens 128] [--rounds 3]

Writes bench/results/serve_tbt_overhead.json. Clients must not steal the server's CPU (in
production they run elsewhere), so on a machine with few cores the model gets one core and one
torch thread, in the baseline and in the server alike, and the clients another core. The
server's HTTP event loop shares the engine's core, which is the overhead being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
PROMPT = "Mixture of experts routes each token to a few experts"


SERVER_CPU, CLIENT_CPU = 0, 1


def baseline_step_s(model: str | None, streams: int, tokens: int, max_model_len: int) -> float:
    """Median duration of engine steps that decode all `streams` sequences at once, on the
    server's core with the server's thread count."""
    import torch

    from moeserve import LLM, SamplingParams

    os.sched_setaffinity(0, {SERVER_CPU})
    torch.set_num_threads(1)
    from moeserve.engine.stats import IterationStats

    durations: list[tuple[int, float]] = []

    class Recorder:
        def record(self, stats: IterationStats) -> None:
            if stats.step_duration_s is not None:
                durations.append((stats.num_generation_tokens, stats.step_duration_s))

    llm = LLM(model, max_model_len=max_model_len, max_num_seqs=streams, stat_loggers=[Recorder()])
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT] * streams, params, use_tqdm=False)  # warm-up
    durations.clear()
    llm.generate([f"{PROMPT} {i}" for i in range(streams)], params, use_tqdm=False)
    full = [d for n, d in durations if n == streams][1:]  # batches of all decodes, skipping the prefill step
    return statistics.median(full)


async def one_stream(http: httpx.AsyncClient, tokens: int) -> tuple[float, int, list[float]]:
    """(client TBT of this stream, tokens received, arrival times of chunks)."""
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, usage = [], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                times.append(now)
    return (times[-1] - times[0]) / (usage - 1), usage, times


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for name in ("engine_step_duration_seconds", "time_between_tokens_seconds"):
        for stat in ("sum", "count"):
            match = re.search(rf"^moeserve:{name}_{stat}\{{[^}}]*\}} (\S+)$", text, re.M)
            values[f"{name}_{stat}"] = float(match.group(1))
    return values


def start_server(model: str | None, streams: int, max_model_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    args = [
        sys.executable,
        "-m",
        "moeserve",
        "launch",
        "--port",
        "0",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(streams),
    ]
    if model:
        args += ["--model", model]
    proc = subprocess.Popen(
        args,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: os.sched_setaffinity(0, {SERVER_CPU}),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"listening on (http://\S+?):(\d+)", log.read_text())
        if match:
            url = f"{match.group(1)}:{match.group(2)}"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"server did not start:\n{log.read_text()}")


async def load_round(url: str, streams: int, tokens: int) -> list[tuple[float, int, list[float]]]:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(one_stream(http, tokens) for _ in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    max_model_len = args.tokens + 64

    base = baseline_step_s(args.model, args.streams, args.tokens, max_model_len)
    print(f"baseline: median step with {args.streams} decodes = {1000 * base:.2f} ms")

    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = start_server(args.model, args.streams, max_model_len, log)
    os.sched_setaffinity(0, {CLIENT_CPU})
    try:
        asyncio.run(load_round(url, args.streams, 8))  # warm-up: connections, first steps
        before = scrape(url)
        client_tbts, gaps = [], []
        for _ in range(args.rounds):
            for tbt, _, times in asyncio.run(load_round(url, args.streams, args.tokens)):
                client_tbts.append(tbt)
                gaps.extend(b - a for a, b in zip(times, times[1:]))
        after = scrape(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    def mean_of(name: str) -> float:
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / (after[f"{name}_count"] - before[f"{name}_count"])

    client_tbt = statistics.median(client_tbts)
    gaps.sort()
    result = {
        "device": (
            f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; engine and HTTP loop "
            f"pinned to core {SERVER_CPU} (1 torch thread), clients to core {CLIENT_CPU}"
        ),
        "model": args.model or "built-in demo (qwen3_moe, bf16)",
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "baseline_step_ms": 1000 * base,
        "client_tbt_median_ms": 1000 * client_tbt,
        "client_chunk_gap_p50_ms": 1000 * gaps[len(gaps) // 2],
        "client_chunk_gap_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)],
        "server_step_mean_ms": 1000 * mean_of("engine_step_duration_seconds"),
        "server_tbt_mean_ms": 1000 * mean_of("time_between_tokens_seconds"),
        "overhead_vs_bare_step": client_tbt / base - 1,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_tbt_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
