"""`moeserve launch` on the GPU and `moeserve bench serve` against it: throughput and SLO attainment.

    python bench/gpu/serve.py [--kernels torch triton] [--num-prompts 200] [--rate 16]

Model: a random-weight Qwen3-MoE written by `make-model` (4 layers, hidden 1024, 32 experts, top-4,
expert intermediate 512, 8 heads / 2 KV heads of 128, bf16). For each kernels backend the server
runs as users run it (`python -m moeserve launch`, a child process on a free port), and the load
test as users run it (`python -m moeserve bench serve`), twice: every request at once (capacity:
output tokens/s) and a Poisson load at --rate req/s judged against --slo-ttft-ms / --slo-tbt-ms
(attainment, with the server's own SLO counters cross-checked).

Writes bench/results/serve.json (or --out) after every run; each server's log lands beside it.
Exit 1: a server did not come up or a request failed; 2: no CUDA device (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
MODEL = dict(
    arch="qwen3_moe",
    layers=4,
    hidden=1024,
    experts=32,
    top_k=4,
    heads=8,
    kv_heads=2,
    head_dim=128,
    moe_intermediate=512,
    dtype="bfloat16",
    max_position_embeddings=4096,
)
LISTENING = re.compile(r"listening on (http://\S+?):(\d+)")
KERNELS = ("torch", "triton")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this and `check_commands` with its own command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same stage, slowly")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=16.0, help="req/s of the SLO run")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-tbt-ms", type=float, default=100.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--startup-timeout", type=float, default=240.0, help="seconds for a server to be healthy")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    return parser.parse_args(argv)


def launch_argv(args: argparse.Namespace, model: Path, kernels: str) -> list[str]:
    return [
        *("launch", "--model", str(model), "--device", args.device, "--dtype", "bfloat16", "--kernels", kernels),
        *("--port", "0", "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", "8GiB"),
        *("--max-model-len", str(args.input_len + args.output_len + 16)),
        *("--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tbt-ms", str(args.slo_tbt_ms)),
    ]


def bench_argv(args: argparse.Namespace, url: str, rate: str, result: Path) -> list[str]:
    argv = [
        *("bench", "serve", "--base-url", url, "--num-prompts", str(args.num_prompts), "--seed", "0"),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos"),
        *("--request-rate", rate, "--save-result", str(result), "--disable-tqdm"),
    ]
    if rate != "inf":
        argv += ["--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tbt:{args.slo_tbt_ms:g}"]
    return argv


def runs(args: argparse.Namespace) -> dict[str, str]:
    """Name -> offered rate of each load test against one server."""
    return {"capacity": "inf", "slo": f"{args.rate:g}"}


def check_commands(args: argparse.Namespace) -> None:
    """Parse every command line this run would start with moeserve's own parser (no server, no GPU)."""
    from moeserve.cli import build_parser
    from moeserve.loadtest.cli import config_from_args

    parser = build_parser()
    for kernels in args.kernels:
        parser.parse_args(launch_argv(args, Path("model"), kernels))
    for rate in runs(args).values():
        config_from_args(parser.parse_args(bench_argv(args, "http://127.0.0.1:1", rate, Path("result.json"))))


class Server:
    """A `moeserve launch` child in its own process group, its output in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve", *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path.name}")
            match = url or LISTENING.search(self.log_path.read_text())
            url = url or (f"{match.group(1)}:{match.group(2)}" if match else None)
            if url is not None:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                        if response.status == 200:
                            return url
                except OSError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy within {timeout:.0f} s; see {self.log_path.name}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def summarize(doc: dict) -> dict:
    run = doc["runs"][0]
    keep = ("request_rate", "duration_s", "num_completed", "num_failed", "errors", "request_throughput")
    out = {k: run[k] for k in keep}
    out |= {
        "output_throughput": run["output_throughput"],
        "goodput": run["goodput"],
        "attainment": run["attainment"],
        "ttft_ms": run["ttft_ms"],
        "tbt_ms": run["tbt_ms"],
        "cross_check": {k: run["cross_check"][k] for k in ("available", "server", "client")},
    }
    return out


def serve_one(args: argparse.Namespace, model: Path, kernels: str, work: Path) -> dict:
    server = Server(launch_argv(args, model, kernels), args.out.parent / f"serve_{kernels}.log")
    entry: dict = {"kernels": kernels, "log": server.log_path.name}
    try:
        started = time.perf_counter()
        url = server.wait_healthy(args.startup_timeout)
        entry["startup_s"] = time.perf_counter() - started
        for name, rate in runs(args).items():
            result = work / f"{kernels}_{name}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "moeserve", *bench_argv(args, url, rate, result)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode != 0 or not result.exists():
                entry[name] = {"error": f"bench serve exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
                continue
            entry[name] = summarize(json.loads(result.read_text()))
    except Exception as e:  # noqa: BLE001 - recorded; the other backend still runs
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        entry["server_exit"] = server.stop()
    entry["passed"] = "error" not in entry and all(
        "error" not in entry[name] and entry[name]["num_failed"] == 0 for name in runs(args)
    )
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu/serve.py needs a CUDA device (none here); --device cpu runs it on CPU", file=sys.stderr)
        return 2
    from moeserve.checkpoints import MakeModelSpec, make_model

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": "serve",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": MODEL,
        "load": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "rate")},
        "slo_ms": {"ttft": args.slo_ttft_ms, "tbt": args.slo_tbt_ms},
        "servers": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(MakeModelSpec(**MODEL), Path(tmp) / "model")
        for kernels in args.kernels:
            entry = serve_one(args, model, kernels, Path(tmp))
            record["servers"].append(entry)
            record["passed"] = all(e["passed"] for e in record["servers"])
            args.out.write_text(json.dumps(record, indent=2) + "\n")
            print(json.dumps(entry), flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
