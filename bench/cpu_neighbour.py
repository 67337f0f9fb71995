"""What work on the other CPU does to the engine's step: the bare decode step on core 0 while core
1 is idle or busy with one kind of work, the kinds interleaved round by round.

    python bench/cpu_neighbour.py [--model DIR] [--streams 64] [--tokens 128] [--rounds 5]

Why: `serve_tbt_overhead.py` finds the forward slower in the server's engine core process than
the same forward in its own process, although the core process has core 0 to itself. On a small
VM the two vCPUs may be one physical core's two hardware threads, which the guest cannot see
(lscpu reports one thread per core): then whatever runs on core 1 competes with the step for the
core's caches and load/store units. This bench measures that alone, with no server involved, so
a figure from the serving benches can be read against what the machine does to a step by itself.

Neighbours, each a child process bound to core 1:
- `idle`: nothing.
- `python`: a pure Python loop (integer work, little memory traffic).
- `copy-l2`: torch copying a 512 KiB buffer over and over (L2-resident loads and stores).
- `copy-dram`: torch copying a 64 MiB buffer over and over.
- `http`: the shape of the API process's work with no engine behind it. A FastAPI app streams
  one SSE chunk per request per tick (`--tick-ms`, about a step) to `--streams` httpx clients
  in the same process, as the API process and the bench's clients share core 1 in
  `serve_tbt_overhead.py`'s split layout.

Step: the demo model (or `--model`), `--streams` sequences decoding `--tokens` tokens each with one
torch thread on core 0, as that bench's baseline. Per round and neighbour: the median step over
the steps where every sequence decodes. Reported per neighbour: the median over rounds, and its
ratio to `idle`'s. Writes bench/results/cpu_neighbour.json. Needs two CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from serve_tbt_overhead import ENGINE_CPU as STEP_CPU
from serve_tbt_overhead import OTHER_CPU as NEIGHBOUR_CPU
from serve_tbt_overhead import PROMPT, bare_step_timer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NEIGHBOURS = ("idle", "python", "copy-l2", "copy-dram", "http")


def run_neighbour(kind: str, streams: int, tick_s: float) -> None:
    """The child: `kind`'s work on core 1 until killed."""
    os.sched_setaffinity(0, {NEIGHBOUR_CPU})
    if kind == "python":
        n = 0
        while True:
            n = (n * 31 + 7) % 1000003
    if kind in ("copy-l2", "copy-dram"):
        import torch

        torch.set_num_threads(1)
        source = torch.ones((512 << 10 if kind == "copy-l2" else 64 << 20) // 4)
        target = torch.empty_like(source)
        while True:
            target.copy_(source)
    if kind == "http":
        asyncio.run(_http_load(streams, tick_s))


async def _http_load(streams: int, tick_s: float) -> None:
    import httpx
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    tick = asyncio.Event()

    async def ticker() -> None:
        nonlocal tick
        while True:
            await asyncio.sleep(tick_s)
            current, tick = tick, asyncio.Event()
            current.set()

    @app.post("/v1/completions")
    async def completions(body: dict) -> StreamingResponse:
        async def chunks():
            for _ in range(body["max_tokens"]):
                await tick.wait()
                choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}
                chunk = {"id": "cmpl-neighbour", "object": "text_completion", "model": "m", "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    asyncio.create_task(ticker())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]

    async def stream(http: httpx.AsyncClient) -> None:
        body = {"prompt": PROMPT, "max_tokens": 128, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as http:
        while True:
            await asyncio.gather(*(stream(http) for _ in range(streams)))
    await serving


def start_neighbour(kind: str, args: argparse.Namespace) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    role = ["--neighbour", kind, "--streams", str(args.streams), "--tick-ms", str(args.tick_ms)]
    child = subprocess.Popen([sys.executable, __file__, *role])
    time.sleep(2.0 if kind == "http" else 0.3)  # the HTTP load needs its connections up
    if child.poll() is not None:
        raise RuntimeError(f"neighbour {kind} exited with status {child.returncode}")
    return child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tick-ms", type=float, default=8.0, help="the http neighbour's time between chunks")
    parser.add_argument("--neighbour", choices=NEIGHBOURS, help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args()
    if args.neighbour:
        run_neighbour(args.neighbour, args.streams, args.tick_ms / 1000)
        return
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two CPUs (0 and 1)", file=sys.stderr)
        sys.exit(2)

    bare_step_s = bare_step_timer(args.model, args.streams, args.tokens, args.tokens + 64)  # moves us to core 0

    steps: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
    for round_index in range(args.rounds):
        order = NEIGHBOURS if round_index % 2 == 0 else tuple(reversed(NEIGHBOURS))
        for kind in order:
            child = start_neighbour(kind, args)
            try:
                steps[kind].append(1000 * bare_step_s())
            finally:
                if child is not None:
                    child.kill()
                    child.wait()
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(f"{k} {steps[k][-1]:.2f} ms" for k in NEIGHBOURS))

    idle = statistics.median(steps["idle"])
    rows = {
        kind: {
            "step_median_ms": statistics.median(values),
            "over_idle": statistics.median(values) / idle,
            "rounds_ms": values,
        }
        for kind, values in steps.items()
    }
    for kind, row in rows.items():
        print(f"{kind:10} step {row['step_median_ms']:6.2f} ms  {row['over_idle']:.2f}x idle")
    result = {
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1m_at_end": os.getloadavg()[0],
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; step on CPU "
        f"{STEP_CPU} with 1 torch thread, neighbour on CPU {NEIGHBOUR_CPU}",
        "model": args.model or "built-in demo",
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "tick_ms": args.tick_ms,
        "neighbours": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_neighbour.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
