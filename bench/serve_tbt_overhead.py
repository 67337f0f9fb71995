"""What serving costs per token: 64 streaming clients' time between tokens vs the bare model step.

Baseline (this process): the engine alone steps a batch of 64 decoding sequences; the median
time of a step where all 64 decode is the floor any server could reach for that batch.
Measured: `moeserve launch` on the same model in a child process, 64 concurrent streaming
clients (raw HTTP, this process). Per stream, TBT is (last token time - first token time) /
(tokens - 1) as the client sees it; the overhead is median client TBT / median baseline step - 1.
Baseline and server take turns, one baseline before each round of streams, because a shared
host's speed drifts by tens of percent over minutes: a baseline timed once, minutes away from
the load, measures the drift as much as the server.
The server's own view (/metrics: step time and engine-side TBT) tells whether the overhead is in
the step (the engine thread slowed by the HTTP side) or in delivery.

    python bench/serve_tbt_overhead.py [--model DIR] [--streams 64] [--tokens 128] [--rounds 7]
                                       [--layout split|shared]

Writes bench/results/serve_tbt_overhead.json (one entry per layout measured). Besides the
clients' view it records the CPU time the API process and the engine core process spent per
engine step (from /proc: user + system time over the measured rounds, divided by the steps
/metrics counted), which a busy machine disturbs far less than wall-clock latencies.

CPU layout (two cores are enough; the model gets one core and one torch thread, in the baseline
and in the server alike):
- `split` (default): the engine core process alone on core 0; the API process and the clients
  on core 1. This is how the server runs: the engine core is its own process so that HTTP,
  detokenization and SSE never take CPU from the step, and `--cpu-binding auto` (the default,
  used here) gives the API process a CPU of its own whenever there are two. The question it
  answers is the one a user has: with the server laid out as shipped, how much later than the
  bare step does each token reach a client? The clients share the API process's core because
  two cores leave no third for them; they are what stands in for the network.
- `shared`: the engine core and the API process both on core 0, clients on core 1 (the layout
  before the core process existed, kept for comparison): every millisecond of API work per step
  is then a millisecond the step waits, so it measures the API process's cost per step, in
  wall time, more than serving as shipped.
The bare-step baseline runs on core 0 with one torch thread in both: the engine core's own
core and threads.
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
from collections.abc import Callable
from pathlib import Path

import httpx

from moeserve.cpu_features import cpu_has_native_bf16

RESULTS = Path(__file__).parent / "results"
PROMPT = "Mixture of experts routes each token to a few experts"


ENGINE_CPU, OTHER_CPU = 0, 1
LAYOUTS = {
    # layout: (CPUs the server process may use, the clients' CPU); in `split` the server's
    # --cpu-binding auto puts the engine core on the first and the API process on the last.
    "split": ({ENGINE_CPU, OTHER_CPU}, OTHER_CPU),
    "shared": ({ENGINE_CPU}, OTHER_CPU),
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_pid(api_pid: int) -> int:
    """The engine core process: the API process's child running `moeserve.engine.core_process`."""
    for entry in Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split():
        if b"moeserve.engine.core_process" in Path(f"/proc/{entry}/cmdline").read_bytes():
            return int(entry)
    raise RuntimeError(f"no engine core process under pid {api_pid}")


def bare_step_timer(model: str | None, streams: int, tokens: int, max_model_len: int) -> Callable[[], float]:
    """An engine in this process, on the engine core's core with its thread count, warmed up; the
    function returned moves this process to that core, generates `streams` sequences of `tokens`
    tokens and gives the median duration of the steps that decoded all of them at once
    (seconds). `cpu_neighbour.py` times its step with it too."""
    import torch

    from moeserve import LLM, SamplingParams

    os.sched_setaffinity(0, {ENGINE_CPU})
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
    prompts = [f"{PROMPT} {i}" for i in range(streams)]

    def median_step_s() -> float:
        os.sched_setaffinity(0, {ENGINE_CPU})
        durations.clear()
        llm.generate(prompts, params, use_tqdm=False)
        full = [d for n, d in durations if n == streams][1:]  # batches of all decodes, skipping the prefill step
        return statistics.median(full)

    return median_step_s


def completion_request(url: str, tokens: int) -> bytes:
    """The raw HTTP request of one stream: a streamed completion of `tokens` tokens."""
    body = json.dumps(
        {
            "prompt": PROMPT,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    host = url.removeprefix("http://")
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


async def one_stream(url: str, tokens: int) -> list[tuple[float, bytes]]:
    """Stream one completion; its response's chunks with their arrival times.

    A bare socket client that does nothing per chunk but timestamp it: the clients share a core
    with the API process, and a client that parsed every chunk with an HTTP library as it came
    would take CPU the API process needs (httpx took about 4.6 ms a step for 64 streams, more
    than the API process itself), and the queueing that caused would count as serving overhead.
    `stream_timing` reads the chunks once the round is over."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(completion_request(url, tokens))
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status.decode().strip()}")
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" not in headers:
            raise RuntimeError("expected a chunked streaming response")
        chunks = []
        while size := int((await reader.readline()).split(b";")[0], 16):
            chunks.append((time.perf_counter(), await reader.readexactly(size + 2)))  # the chunk and its CRLF
        return chunks
    finally:
        writer.close()


def stream_timing(chunks: list[tuple[float, bytes]]) -> tuple[float, int, list[float]]:
    """(client TBT, tokens received, arrival time of each token) of one stream's chunks. TBT is
    (last token's time - first token's time) / (tokens - 1); tokens are the usage's count."""
    token_times, usage = [], None
    for arrived, data in chunks:
        for line in data.decode().split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            elif event["choices"]:
                token_times.append(arrived)
    return (token_times[-1] - token_times[0]) / (usage - 1), usage, token_times


METRIC_SERIES = tuple(
    f"{name}_{stat}"
    for name in ("engine_step_duration_seconds", "time_between_tokens_seconds")
    for stat in ("sum", "count")
)


def scrape(url: str) -> dict[str, float]:
    """The server's `METRIC_SERIES` now."""
    text = httpx.get(f"{url}/metrics").text
    return {
        series: float(re.search(rf"^moeserve:{series}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))
        for series in METRIC_SERIES
    }


def start_server(
    model: str | None, streams: int, max_model_len: int, log: Path, cpus: set[int]
) -> tuple[subprocess.Popen, str]:
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
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
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


def load_round(url: str, streams: int, tokens: int) -> list[tuple[float, int, list[float]]]:
    """`streams` concurrent streams of `tokens` tokens: each one's `stream_timing`."""

    async def all_streams() -> list[list[tuple[float, bytes]]]:
        return await asyncio.gather(*(one_stream(url, tokens) for _ in range(streams)))

    return [stream_timing(chunks) for chunks in asyncio.run(all_streams())]


def measure(args: argparse.Namespace, layout: str, bare_step_s: Callable[[], float], max_model_len: int) -> dict:
    """One server in `layout`, driven by `args.rounds` rounds of streams, each after a baseline:
    its entry of the results."""
    server_cpus, client_cpu = LAYOUTS[layout]
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = start_server(args.model, args.streams, max_model_len, log, server_cpus)
    try:
        os.sched_setaffinity(0, {client_cpu})
        load_round(url, args.streams, 8)  # warm-up: connections, first steps
        core = core_pid(proc.pid)
        client_tbts, gaps, rounds = [], [], []
        api_cpu = core_cpu = client_cpu_s = 0.0
        totals = dict.fromkeys(METRIC_SERIES, 0.0)  # the /metrics series summed over the measured rounds
        for _ in range(args.rounds):
            base = bare_step_s()  # the server idles meanwhile
            os.sched_setaffinity(0, {client_cpu})
            before = scrape(url)
            api_before, core_before, clients_before = cpu_seconds(proc.pid), cpu_seconds(core), cpu_seconds(os.getpid())
            streams = load_round(url, args.streams, args.tokens)
            api_cpu += cpu_seconds(proc.pid) - api_before
            core_cpu += cpu_seconds(core) - core_before
            client_cpu_s += cpu_seconds(os.getpid()) - clients_before
            after = scrape(url)
            for series in totals:
                totals[series] += after[series] - before[series]
            round_tbts = [tbt for tbt, _, _ in streams]
            client_tbts.extend(round_tbts)
            rounds.append(
                {"baseline_step_ms": 1000 * base, "client_tbt_median_ms": 1000 * statistics.median(round_tbts)}
            )
            for _, _, times in streams:
                gaps.extend(b - a for a, b in zip(times, times[1:]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    def mean_of(name: str) -> float:
        return totals[f"{name}_sum"] / totals[f"{name}_count"]

    steps = totals["engine_step_duration_seconds_count"]
    base = statistics.median(r["baseline_step_ms"] for r in rounds) / 1000
    client_tbt = statistics.median(client_tbts)
    gaps.sort()
    placement = (
        f"engine core on core {ENGINE_CPU}, API process and clients on core {OTHER_CPU}"
        if layout == "split"
        else f"engine core and API process on core {ENGINE_CPU}, clients on core {OTHER_CPU}"
    )
    return {
        "layout": layout,
        "placement": placement,
        "baseline_step_median_ms": 1000 * base,
        "client_tbt_median_ms": 1000 * client_tbt,
        "client_chunk_gap_p50_ms": 1000 * gaps[len(gaps) // 2],
        "client_chunk_gap_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)],
        "server_step_mean_ms": 1000 * mean_of("engine_step_duration_seconds"),
        "server_tbt_mean_ms": 1000 * mean_of("time_between_tokens_seconds"),
        "api_process_cpu_per_step_ms": 1000 * api_cpu / steps,
        "api_process_cpu_per_stream_token_us": 1e6 * api_cpu / (args.rounds * args.streams * args.tokens),
        "engine_core_cpu_per_step_ms": 1000 * core_cpu / steps,
        "clients_cpu_per_step_ms": 1000 * client_cpu_s / steps,
        "overhead_vs_bare_step": client_tbt / base - 1,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--layout",
        choices=[*LAYOUTS, "both"],
        default="both",
        help="where the processes run (see above); both: split, then shared, against one baseline",
    )
    args = parser.parse_args()
    max_model_len = args.tokens + 64

    bare_step_s = bare_step_timer(args.model, args.streams, args.tokens, max_model_len)
    layouts = list(LAYOUTS) if args.layout == "both" else [args.layout]
    runs = []
    for layout in layouts:
        runs.append(measure(args, layout, bare_step_s, max_model_len))
        print(
            f"{layout}: baseline step {runs[-1]['baseline_step_median_ms']:.2f} ms, client TBT "
            f"{runs[-1]['client_tbt_median_ms']:.2f} ms, overhead {100 * runs[-1]['overhead_vs_bare_step']:+.1f}%",
            flush=True,
        )
    result = {
        "device": (
            f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; bare step on core "
            f"{ENGINE_CPU} with 1 torch thread, as the engine core in every layout; "
            f"{'native' if cpu_has_native_bf16() else 'no native'} bf16, so --dtype auto computes in "
            f"{'the checkpoint dtype' if cpu_has_native_bf16() else 'float32'}"
        ),
        "model": args.model or "built-in demo (qwen3_moe, bf16)",
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "layouts": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_tbt_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
