"""`moeserve bench serve` against a real moeserve, run as a user runs it (its CLI in a subprocess):
the result file against the schema documented in docs/bench-serve.md, the rate search against a
server of known capacity, and the cross-check against the server's own SLO counters."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_utils import ServerProcess

from moeserve.loadtest.datasets import random_prompts

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench-serve.md"
STEP_MS = 40.0  # the slowed server's step floor: far above the tiny model's ~2 ms of compute
CROSS_CHECK_TTFT_MS = 625.0
CROSS_CHECK_TBT_MS = 10.0  # below the step floor: every request with a gap misses it


@pytest.fixture(scope="module")
def ascii_checkpoint(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test checkpoint with its output head rescaled so that it only emits ASCII tokens.

    A random-weight model otherwise draws byte tokens that decode to incomplete UTF-8 characters,
    which the server holds back and sends with a later token: the first visible text and the
    chunk gaps would depend on which tokens were drawn rather than on the server's timing. ASCII
    rows are scaled by 100 (their logits spread over hundreds) and the others zeroed (logit 0),
    so sampling at temperature 1 never picks a non-ASCII token, and every token is one chunk.
    """
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("ascii") / "checkpoint"
    shutil.copytree(server_checkpoint, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ascii_ids = [
        i
        for i in range(tokenizer.get_vocab_size())
        if (text := tokenizer.decode([i], skip_special_tokens=True)) and text.isascii()
    ]
    weights = load_file(folder / "model.safetensors")
    head = weights["lm_head.weight"]
    scale = torch.zeros(head.shape[0], dtype=head.dtype)
    scale[ascii_ids] = 100.0
    weights["lm_head.weight"] = (head * scale[:, None]).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def slow_server(start_server, ascii_checkpoint: Path):
    """One request at a time, every step at least STEP_MS: a server of known capacity.

    One torch thread, so a busy 2-core machine stalls its steps less."""
    server = start_server(
        "--model",
        str(ascii_checkpoint),
        "--max-num-seqs",
        "1",
        "--debug-min-step-time-ms",
        str(STEP_MS),
        "--slo-ttft-ms",
        str(CROSS_CHECK_TTFT_MS),
        "--slo-tbt-ms",
        str(CROSS_CHECK_TBT_MS),
        env={"OMP_NUM_THREADS": "1"},
    )
    yield server
    server.stop()


def bench(out_dir: Path, server: ServerProcess, *args: str) -> tuple[dict, str]:
    """Run `bench serve` against `server`; its JSON document and terminal output."""
    result_file = out_dir / "result.json"
    command = [
        sys.executable,
        "-m",
        "moeserve.loadtest.cli",
        "serve",
        "--base-url",
        server.url,
        "--disable-tqdm",
        "--save-result",
        str(result_file),
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return json.loads(result_file.read_text()), done.stdout


def documented_schema() -> dict[str, str]:
    """Path -> type of every field in the JSON schema table of docs/bench-serve.md."""
    section = DOCS.read_text().split("\n## JSON schema\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+) \|", section, re.M)}


def json_paths(value: object, maps: set[str], prefix: str = "") -> set[str]:
    """Every field path in a document (`[]` for list elements), not descending into maps."""
    paths = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            if path not in maps:
                paths |= json_paths(item, maps, path)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                paths |= json_paths(item, maps, prefix + "[]")
    return paths


def check_schema(doc: dict, *, search: bool) -> None:
    schema = documented_schema()
    assert len(schema) > 100
    paths = json_paths(doc, {path for path, kind in schema.items() if kind == "map"})
    assert paths - set(schema) == set(), "fields missing from the schema in docs/bench-serve.md"
    absent = set() if search else {path for path in schema if path.startswith("search.")}
    assert set(schema) - paths == absent, "documented fields missing from the result"


def test_a_run_of_30_requests_fills_the_documented_schema(start_server, ascii_checkpoint: Path, tmp_path: Path) -> None:
    """Acceptance 2: 30 requests at 10 req/s; every request succeeds and every documented field is there."""
    server = start_server("--model", str(ascii_checkpoint))
    doc, stdout = bench(
        tmp_path,
        server,
        "--num-prompts",
        "30",
        "--request-rate",
        "10",
        "--random-input-len",
        "8",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.5",
        "--ignore-eos",
        "--goodput",
        "ttft:2000",
        "tbt:1000",
        "tpot:1000",
        "e2el:10000",
        "--plot",
        str(tmp_path / "run.png"),
    )
    check_schema(doc, search=False)
    assert (doc["mode"], doc["config"]["model"], doc["config"]["request_rate"]) == ("single", "tiny", 10.0)
    run = doc["runs"][0]
    assert (run["num_prompts"], run["num_sent"], run["num_completed"], run["num_failed"], run["errors"]) == (
        30,
        30,
        30,
        0,
        {},
    )
    prompts = random_prompts(30, 8, 8, 0.5, 300, seed=0, as_text=False)  # what the harness sent
    requests = run["requests"]
    assert [r["index"] for r in requests] == list(range(30))
    assert all(r["ok"] and r["error"] is None and r["token_source"] == "usage" for r in requests)
    assert [r["output_tokens"] for r in requests] == [p.output_len for p in prompts]
    assert [r["prompt_tokens"] for r in requests] == [p.prompt_len for p in prompts]
    # a token per chunk, or several when the server's stream falls behind its engine and merges them
    assert all(len(r["tbt_ms"]) < r["output_tokens"] for r in requests)
    assert run["tbt_ms"]["count"] == sum(len(r["tbt_ms"]) for r in requests)
    assert run["total_output_tokens"] == sum(p.output_len for p in prompts)
    assert sorted(run["attainment"]) == ["all", "e2el", "tbt", "tpot", "ttft"]
    cross = run["cross_check"]
    assert cross["available"] and cross["server_requests"] == cross["client_requests"] == 30
    assert "Serving benchmark at 10 req/s" in stdout and "Cross-check with server /metrics" in stdout
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_find_max_goodput_rate_finds_the_analytic_knee(slow_server: ServerProcess, tmp_path: Path) -> None:
    """Acceptance 3: the search lands within 25% of the knee computed from the server's capacity.

    The server runs one request at a time (--max-num-seqs 1) and every step takes d = 40 ms. A
    request of L = 5 output tokens (--ignore-eos) takes one prefill step, which yields the first
    token, and L - 1 decode steps: service time S = L*d = 200 ms, capacity mu = 1/S = 5 req/s.
    Arrivals are near-deterministic (--burstiness 1e4: CV 1%), request i (from 0) at i/lambda.
    Below capacity nobody waits: TTFT = d + eps (eps: HTTP, a few ms). Above it, request i waits
    w_i = i*(S - 1/lambda), so it meets ttft:T iff i*(S - 1/lambda) <= T - d - eps, and the first
    floor((T - d - eps)/(S - 1/lambda)) + 1 of the N requests meet it. Attainment >= A needs
    m = ceil(A*N) of them, hence

        lambda <= lambda* = 1 / (S - (T - d - eps)/(m - 1)).

    With N = 20, A = 0.9 (m = 18), T = 140 ms and eps = 0: lambda* = 5.15 req/s.
    """
    n, attainment, ttft_ms, output_len = 20, 0.9, 140.0, 5
    service_s, step_s = output_len * STEP_MS / 1000, STEP_MS / 1000
    knee = 1 / (service_s - (ttft_ms / 1000 - step_s) / (math.ceil(attainment * n) - 1))
    doc, stdout = bench(
        tmp_path,
        slow_server,
        "--num-prompts",
        str(n),
        "--random-input-len",
        "4",
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--burstiness",
        "10000",
        "--goodput",
        f"ttft:{ttft_ms:g}",
        "--find-max-goodput-rate",
        "--slo-attainment",
        str(attainment),
        "--search-start-rate",
        "4",
        "--search-tolerance",
        "0.05",
        "--duration",
        "15",
        "--timeout",
        "15",
        "--plot",
        str(tmp_path / "search.png"),
    )
    check_schema(doc, search=True)
    search = doc["search"]
    probes = [(p["request_rate"], p["attainment"]) for p in search["probes"]]
    assert search["bracketed"], probes
    assert abs(search["max_goodput_rate"] - knee) <= 0.25 * knee, (
        f"found {search['max_goodput_rate']}, expected {knee:.3f}; probes {probes}"
    )
    assert [r["request_rate"] for r in doc["runs"]] == [rate for rate, _ in probes]
    assert f"Max goodput rate: {search['max_goodput_rate']:.4g} req/s" in stdout
    assert (tmp_path / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cross_check_agrees_with_the_servers_slo_counters(slow_server: ServerProcess, tmp_path: Path) -> None:
    """Client-side TTFT/TBT attainment against the server's targets matches its counter deltas.

    Every fourth request asks for one token (no gap: it meets the TBT target on both sides), the
    others for six, whose 40 ms gaps miss the 10 ms target: TBT attainment is exactly 5/20 on
    both sides. Arriving at 10 req/s, twice the capacity, requests queue, so TTFT attainment is
    mixed (about 7 of 20 meet 625 ms, the nearest tens of ms from the target); the sides may
    differ only by requests within a few ms (the HTTP legs) of the target.
    """
    lengths = [1 if i % 4 == 0 else 6 for i in range(20)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": [11, 12, 13, 14], "output_len": n}) + "\n" for n in lengths))
    doc, stdout = bench(
        tmp_path,
        slow_server,
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        "20",
        "--request-rate",
        "10",
        "--burstiness",
        "10000",
        "--ignore-eos",
        "--timeout",
        "30",
    )
    run = doc["runs"][0]
    assert run["num_completed"] == 20
    check = run["cross_check"]
    assert check["available"], check["reason"]
    assert check["targets_ms"] == {"ttft": CROSS_CHECK_TTFT_MS, "tbt": CROSS_CHECK_TBT_MS}
    assert check["server_requests"] == check["client_requests"] == 20
    assert check["server"]["tbt"] == check["client"]["tbt"] == 5 / 20
    assert 0.1 <= check["server"]["ttft"] <= 0.9, check  # mixed, so agreeing is not trivial
    assert abs(check["client"]["ttft"] - check["server"]["ttft"]) <= 2 / 20, check
    assert "Cross-check with server /metrics" in stdout
