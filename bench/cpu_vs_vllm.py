"""moeserve against vLLM's CPU build: one checkpoint, one load generator, one run.

Both servers serve the same tiny random-weight Mixtral (float32, hidden 128, 8 experts top-2,
head_dim 32: vLLM's CPU attention refuses 16), one at a time on the same port, and both are
driven by vLLM's own load generator, `vllm bench serve` (random 64 in / 32 out, 96 prompts,
--ignore-eos, greedy), at each concurrency. The load generator is vLLM's so that neither side is
measured by a client of its own making; the same client process runs against both.

vLLM lives in its own virtual environment (it pins its own torch), made once by the recipe in the
peers folder (`setup_vllm_cpu.sh`, a few minutes) and driven through its `vllm_cli.py` wrapper.

    python bench/cpu_vs_vllm.py [--peers DIR] [--vllm-venv DIR] [--concurrency 8 32] [--rounds 1]

Writes bench/results/cpu_vs_vllm.json: per server and concurrency, output tok/s, TTFT median,
TPOT median and ITL p99 (medians over rounds; rounds alternate which server goes first, so a
slow drift of the machine does not favour one), the ratios moeserve / vLLM, the machine (cores,
the CPU flags that decide bf16 speed) and the versions. Timings are only comparable within one
run: on a shared machine the ratios are what to read, not the absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PEERS_ENV = "MOESERVE_PEERS_DIR"
VENV_ENV = "MOESERVE_VLLM_VENV"
MAX_MODEL_LEN = 256  # 64 in + 32 out fits with room; the README's recipe for the vLLM server
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
METRICS = ("output_tok_s", "ttft_median_ms", "tpot_median_ms", "itl_p99_ms")
HIGHER_IS_BETTER = {"output_tok_s"}
SERVERS = ("moeserve", "vllm")


@dataclass(frozen=True)
class BenchConfig:
    """One run's settings; the load's defaults are issue 12's, so runs stay comparable."""

    peers_dir: Path
    """Folder with setup_vllm_cpu.sh and vllm_cli.py."""
    vllm_venv: Path
    """vLLM's virtual environment, made by setup_vllm_cpu.sh if it does not import vllm yet."""
    concurrency: tuple[int, ...] = (8, 32)
    num_prompts: int = 96
    input_len: int = 64
    output_len: int = 32
    rounds: int = 1
    """Times each server is started and measured; rounds alternate the order of the servers."""
    port: int = 0
    """Port both servers take in turn; 0 picks a free one once."""
    startup_timeout_s: float = 900.0
    """vLLM's CPU build takes minutes to start on a busy 2-core machine."""
    out: Path = RESULTS / "cpu_vs_vllm.json"
    note: str = ""
    """Free text recorded with the results, e.g. what else was running."""
    keep: bool = False
    """Keep the work folder (checkpoint, server and client logs, raw client results)."""

    def __post_init__(self) -> None:
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise ValueError(f"concurrency={self.concurrency}: give one or more positive values")
        for name in ("num_prompts", "input_len", "output_len", "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.input_len + self.output_len > MAX_MODEL_LEN:
            raise ValueError(f"input_len + output_len must fit max_model_len={MAX_MODEL_LEN}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> BenchConfig:
    """The command line as a `BenchConfig`. The peers folder defaults to `../shared/peers` beside
    the repository and the venv to `../peers/vllm-cpu`; environment variables override both."""
    environ = os.environ if environ is None else environ
    default_peers = environ.get(PEERS_ENV) or REPO.parent / "shared" / "peers"
    default_venv = environ.get(VENV_ENV) or REPO.parent / "peers" / "vllm-cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=Path, default=Path(default_peers), help=f"peers folder (${PEERS_ENV})")
    p.add_argument("--vllm-venv", type=Path, default=Path(default_venv), help=f"vLLM's venv (${VENV_ENV})")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server gets to turn healthy")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_vs_vllm.json")
    p.add_argument("--note", default="", help="recorded with the results")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the logs (kept anyway on failure)")
    args = p.parse_args(argv)
    try:
        return BenchConfig(
            peers_dir=args.peers,
            vllm_venv=args.vllm_venv,
            concurrency=tuple(args.concurrency),
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            rounds=args.rounds,
            port=args.port,
            startup_timeout_s=args.startup_timeout,
            out=args.out,
            note=args.note,
            keep=args.keep,
        )
    except ValueError as exc:
        p.error(str(exc))


# --- results: parsing vllm bench serve's JSON, medians over rounds, ratios, the table ---------


@dataclass(frozen=True)
class Metrics:
    """What one `vllm bench serve` run reports that this bench compares (`METRICS`), and the
    prompt tokens it sent: the client trims prompts to the server's tokenizer only where the
    server has vLLM's /tokenize route, so the two loads can differ by a few tokens; this shows
    by how much."""

    output_tok_s: float
    ttft_median_ms: float
    tpot_median_ms: float
    itl_p99_ms: float
    input_tokens: int


def read_bench_result(result: Mapping[str, object], num_prompts: int) -> Metrics:
    """The metrics of one saved `vllm bench serve` result; a run that lost requests is an error,
    since its throughput would describe a different load."""
    failed, completed = result.get("failed", 0), result.get("completed")
    if failed or completed != num_prompts:
        raise RuntimeError(f"vllm bench serve completed {completed} of {num_prompts} requests ({failed} failed)")
    keys = {
        "output_tok_s": "output_throughput",
        "ttft_median_ms": "median_ttft_ms",
        "tpot_median_ms": "median_tpot_ms",
        "itl_p99_ms": "p99_itl_ms",
    }
    missing = [key for key in [*keys.values(), "total_input_tokens"] if key not in result]
    if missing:
        raise KeyError(f"vllm bench serve result lacks {missing} (run with --metric-percentiles 50,99)")
    values = {name: float(result[key]) for name, key in keys.items()}
    return Metrics(**values, input_tokens=int(result["total_input_tokens"]))


def median_metrics(runs: Sequence[Metrics]) -> Metrics:
    """Each metric's median over rounds: one slow round on a shared machine does not set it."""
    if not runs:
        raise ValueError("no runs to summarise")
    medians = {name: statistics.median(getattr(r, name) for r in runs) for name in METRICS}
    return Metrics(**medians, input_tokens=round(statistics.median(r.input_tokens for r in runs)))


def ratios(ours: Metrics, theirs: Metrics) -> dict[str, float]:
    """moeserve / vLLM per metric: >= 1 is better for tok/s, <= 1 for the latencies."""
    return {name: getattr(ours, name) / getattr(theirs, name) for name in METRICS}


def format_table(rows: Mapping[int, Mapping[str, Metrics]], labels: Mapping[str, str]) -> str:
    """A markdown table: per concurrency, vLLM's row, moeserve's row and their ratio."""
    lines = [
        "| concurrency | server | output tok/s | TTFT median | TPOT median | ITL p99 |",
        "|---|---|---|---|---|---|",
    ]
    for concurrency, by_server in rows.items():
        for server in ("vllm", "moeserve"):
            m = by_server[server]
            lines.append(
                f"| {concurrency} | {labels[server]} | {m.output_tok_s:.0f} | {m.ttft_median_ms:.1f} ms "
                f"| {m.tpot_median_ms:.2f} ms | {m.itl_p99_ms:.1f} ms |"
            )
        r = ratios(by_server["moeserve"], by_server["vllm"])
        cells = " | ".join(f"{r[name]:.2f}x" for name in METRICS)
        lines.append(f"| {concurrency} | moeserve / vLLM | {cells} |")
    return "\n".join(lines)


def cpu_facts(cpuinfo: str) -> dict[str, object]:
    """The CPU's model and the flags that decide bf16 and matmul speed, from /proc/cpuinfo text."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    present = {flag: flag in flags for flag in CPU_FLAGS}
    return {"model": model, "flags": present, "native_bf16": present["avx512_bf16"] or present["amx_bf16"]}


# --- the two servers and the load generator -----------------------------------------------


@dataclass(frozen=True)
class Server:
    """How to start one server: its command and environment (both listen on `port`)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(repr=False)


def _offline_env(base: Mapping[str, str]) -> dict[str, str]:
    """Children read only the local checkpoint: no hub look-ups, no usage reports."""
    return {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_env() -> dict[str, str]:
    """vLLM's environment: the peers README's settings; moeserve's import path left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    return _offline_env(env)


def servers(cfg: BenchConfig, model: Path, port: int) -> dict[str, Server]:
    """Both servers on `model`: float32, the same max_model_len, loopback, `port`."""
    common = ["--model", str(model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    common += ["--host", "127.0.0.1", "--port", str(port)]
    moeserve_env = _offline_env(os.environ)
    moeserve_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {
        "moeserve": Server("moeserve", [sys.executable, "-m", "moeserve", "launch", *common], moeserve_env),
        "vllm": Server(
            "vllm",
            [str(cfg.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", *common],
            vllm_env(),
        ),
    }


def describe(server: Server, model: Path) -> dict[str, object]:
    """A server's command for the record: no interpreter path, `<checkpoint>` for the model, and
    the environment variables that shape it (vLLM's, and the OpenMP thread count if set)."""
    argv = server.argv[1:]
    ours = {
        k: v for k, v in server.env.items() if k.startswith("VLLM_") or k in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
    }
    return {"command": " ".join("<checkpoint>" if a == str(model) else a for a in argv), "env": ours}


def bench_argv(cfg: BenchConfig, model: Path, port: int, concurrency: int, result: Path) -> list[str]:
    """`vllm bench serve` for one concurrency: the same requests (seeded) against either server."""
    return [
        str(cfg.vllm_venv / "bin" / "python"),
        str(cfg.peers_dir / "vllm_cli.py"),
        "bench",
        "serve",
        "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", str(model),
        "--tokenizer", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(cfg.input_len),
        "--random-output-len", str(cfg.output_len),
        "--num-prompts", str(cfg.num_prompts),
        "--max-concurrency", str(concurrency),
        "--num-warmups", str(concurrency),  # one full batch first: neither side pays its first steps
        "--ignore-eos",
        "--temperature", "0",
        "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def serving(server: Server, port: int, log: Path, timeout_s: float) -> Iterator[None]:
    """Run `server` until the block ends. It gets a session of its own, so that SIGTERM reaches
    its children too (vLLM's engine core is a separate process), and the port must be free
    before it starts and again after it stops, so the next server cannot meet a leftover."""
    if not _port_free(port):
        raise RuntimeError(f"port {port} is taken before {server.name} starts")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server.argv, stdout=out, stderr=subprocess.STDOUT, env=server.env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not healthy after {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(1)
        yield
    finally:
        _stop_session(proc)
        deadline = time.monotonic() + 30
        while not _port_free(port) and time.monotonic() < deadline:
            time.sleep(0.5)


def _stop_session(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM the server's session, SIGKILL what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the session?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_load(cfg: BenchConfig, model: Path, port: int, concurrency: int, workdir: Path, tag: str) -> Metrics:
    """One `vllm bench serve` run against whatever listens on `port`."""
    result = workdir / f"{tag}.json"
    log = workdir / f"{tag}.log"
    with open(log, "w") as out:
        done = subprocess.run(
            bench_argv(cfg, model, port, concurrency, result), stdout=out, stderr=subprocess.STDOUT, env=vllm_env()
        )
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{_tail(log)}")
    return read_bench_result(json.loads(result.read_text()), cfg.num_prompts)


# --- setup, facts, and the run ------------------------------------------------------------------


def ensure_vllm(cfg: BenchConfig) -> None:
    """Make vLLM's venv with the peers recipe unless it already imports vllm (the recipe checks)."""
    for name in ("setup_vllm_cpu.sh", "vllm_cli.py"):
        if not (cfg.peers_dir / name).is_file():
            raise FileNotFoundError(f"{cfg.peers_dir / name} is missing: pass --peers or set ${PEERS_ENV}")
    print(f"vLLM venv: {cfg.vllm_venv} (made on first use, minutes)", flush=True)
    subprocess.run(["bash", str(cfg.peers_dir / "setup_vllm_cpu.sh"), str(cfg.vllm_venv)], check=True)


def build_checkpoint(out_dir: Path) -> dict[str, object]:
    """The tiny Mixtral both servers load; returns its spec for the record."""
    from moeserve.checkpoints import MakeModelSpec, make_model

    spec = MakeModelSpec(
        arch="mixtral",
        layers=2,
        hidden=128,
        experts=8,
        top_k=2,
        vocab=512,
        heads=4,
        kv_heads=2,
        head_dim=32,  # vLLM's CPU attention refuses 16
        moe_intermediate=64,
        dtype="float32",
        max_position_embeddings=MAX_MODEL_LEN,
    )
    make_model(spec, out_dir)
    return asdict(spec)


def _run_text(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    return done.stdout.strip() if done.returncode == 0 else f"unknown ({done.stderr.strip()[-200:]})"


def versions(cfg: BenchConfig) -> dict[str, str]:
    """What ran: moeserve's commit, both torches, vLLM, Python."""
    import torch

    import moeserve

    probe = "import importlib.metadata as m, torch; print(m.version('vllm-cpu'), torch.__version__)"
    vllm_version, _, vllm_torch = _run_text([str(cfg.vllm_venv / "bin" / "python"), "-c", probe], vllm_env()).partition(
        " "
    )
    commit = _run_text(["git", "-C", str(REPO), "describe", "--always", "--dirty"])
    return {
        "moeserve": f"{moeserve.__version__} ({commit})",
        "moeserve_torch": torch.__version__,
        "vllm": vllm_version,
        "vllm_torch": vllm_torch,
        "python": platform.python_version(),
    }


def machine() -> dict[str, object]:
    cpuinfo = Path("/proc/cpuinfo")
    facts = cpu_facts(cpuinfo.read_text() if cpuinfo.exists() else "")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {**facts, "cores": os.cpu_count(), "usable_cores": usable, "os": platform.platform()}


def measure(cfg: BenchConfig, model: Path, port: int, workdir: Path) -> dict[int, dict[str, list[Metrics]]]:
    """Every round starts each server once and runs every concurrency against it; odd rounds
    start with vLLM. Returns the runs per concurrency and server."""
    runs: dict[int, dict[str, list[Metrics]]] = {c: {s: [] for s in SERVERS} for c in cfg.concurrency}
    specs = servers(cfg, model, port)
    for round_ in range(cfg.rounds):
        order = SERVERS if round_ % 2 == 0 else SERVERS[::-1]
        for name in order:
            print(f"round {round_ + 1}/{cfg.rounds}: starting {name} on port {port}", flush=True)
            with serving(specs[name], port, workdir / f"{name}-r{round_}.server.log", cfg.startup_timeout_s):
                for c in cfg.concurrency:
                    m = run_load(cfg, model, port, c, workdir, f"{name}-r{round_}-c{c}")
                    print(f"  {name} c={c}: {m}", flush=True)
                    runs[c][name].append(m)
    return runs


def report(
    cfg: BenchConfig, runs: dict[int, dict[str, list[Metrics]]], context: dict[str, object]
) -> tuple[dict[str, object], dict[int, dict[str, Metrics]]]:
    """The JSON record (the load, the medians, the ratios, every round, and `context`), and the
    medians per concurrency and server."""
    medians = {c: {s: median_metrics(by[s]) for s in SERVERS} for c, by in runs.items()}
    return {
        "schema_version": 1,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **context,
        "load": {
            "client": "vllm bench serve --backend openai --dataset-name random --ignore-eos --temperature 0",
            "num_prompts": cfg.num_prompts,
            "input_len": cfg.input_len,
            "output_len": cfg.output_len,
            "concurrency": list(cfg.concurrency),
            "rounds": cfg.rounds,
            "warmup_requests": "one per concurrency slot, before each measured run",
        },
        "results": [
            {
                "concurrency": c,
                **{s: asdict(medians[c][s]) for s in SERVERS},
                "moeserve_over_vllm": ratios(medians[c]["moeserve"], medians[c]["vllm"]),
                "rounds": {s: [asdict(m) for m in runs[c][s]] for s in SERVERS},
            }
            for c in cfg.concurrency
        ],
    }, medians


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        ensure_vllm(cfg)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="cpu_vs_vllm."))
    model = workdir / "model"
    context = {"note": cfg.note, "machine": machine(), "versions": versions(cfg)}
    context["model"] = {
        "checkpoint": build_checkpoint(model),
        "served_dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
    }
    port = cfg.port or free_port()
    context["servers"] = {name: describe(server, model) for name, server in servers(cfg, model, port).items()}
    load_before = os.getloadavg()
    try:
        runs = measure(cfg, model, port, workdir)
    except BaseException:
        print(f"failed; server and client logs kept in {workdir}", file=sys.stderr)
        raise
    context["machine"]["load_average_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    record, medians = report(cfg, runs, context)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(record, indent=2) + "\n")
    labels = {
        "moeserve": f"moeserve {record['versions']['moeserve']}",
        "vllm": f"vLLM CPU {record['versions']['vllm']}",
    }
    print(format_table(medians, labels))
    print(f"wrote {cfg.out}")
    if cfg.keep:
        print(f"checkpoint and logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
