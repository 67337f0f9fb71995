"""Live expert rebalancing seen from outside: /metrics of a running `moeserve launch --enable-eplb`.

A DeepSeek-V3-style checkpoint whose router is skewed Zipf-like (32 routed experts) is served at
ep=4 with 8 redundant slots and a rebalance every `INTERVAL` lockstep steps, planned on the
last `WINDOW` steps: phase B's decode only (prompts of random tokens route unlike the tokens a
model generates, so a window holding prefills would balance for the wrong load). Phase A (16 short
requests, all done long before the rebalance) leaves the contiguous placement's imbalance on the
gauge; phase B (64 greedy sequences in 4 streamed requests) crosses the rebalance and steps on
until the gauge has a value measured wholly under the new placement, which must be balanced.

Timing, by steps rather than sleeps. The ranks report their load about once a second
(`engine.core.ROUTING_INTERVAL_S`) and at every rebalance, which closes the report; the gauge
takes a value once it has `IMBALANCE_MIN_ROWS` rows in a layer and drops those left at a
rebalance. The rebalance comes at step `INTERVAL`; the phases run at least `A_TOKENS + B_TOKENS`
steps (a token each), so at least `POST_STEPS` after it, and `--debug-min-step-time-ms` makes
each last at least `STEP_FLOOR_MS`: over a second, and with 64 sequences x 3 routed experts
over `IMBALANCE_MIN_ROWS` rows, before the end. A loaded machine makes steps longer, never
shorter. The other bound: phase B ends before the next rebalance at `2 * INTERVAL` unless its
requests reach the engine over 24 steps apart.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from statistics import mean

import httpx
import pytest
import torch
from helpers.skewed_router import skew_router
from server_utils import MAX_MODEL_LEN, ServerProcess

from moeserve import LLM, SamplingParams
from moeserve.api.metrics import IMBALANCE_MIN_ROWS

NUM_EXPERTS, EP = 32, 4
MOE_LAYERS = ("1", "2")  # decoder layer 0 is dense (first_k_dense_replace=1)
INTERVAL, WINDOW = 80, 32  # steps between rebalances, and steps of load they plan on
STEP_FLOOR_MS = 40
A_TOKENS, B_TOKENS = 30, 96  # per sequence: phases A and B run at least this many steps each
B_SEQUENCES = 64
POST_STEPS = A_TOKENS + B_TOKENS - INTERVAL
assert POST_STEPS * STEP_FLOOR_MS >= 1000 + 10 * STEP_FLOOR_MS  # a report's second, and 10 steps to spare
assert (POST_STEPS - 2) * B_SEQUENCES * 3 >= 2 * IMBALANCE_MIN_ROWS  # rows for a gauge value, twice over
assert A_TOKENS + 2 + 8 < INTERVAL - WINDOW and A_TOKENS + B_TOKENS + 2 + 24 < 2 * INTERVAL
GREEDY = {"temperature": 0.0, "ignore_eos": True}  # every sequence runs its max_tokens steps


@pytest.fixture(scope="module")
def skewed_checkpoint(make_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = make_checkpoint(
        "deepseek_v3",
        3,
        n_routed_experts=NUM_EXPERTS,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        num_hidden_layers=3,
    )
    return skew_router(base, tmp_path_factory.mktemp("eplb") / "skewed", strength=0.3)


def token_prompts(count: int, seed: int, shortest: int, longest: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest, (count,), generator=g).tolist()
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lengths]


def layer_imbalance(metrics: dict[str, float]) -> list[float]:
    return [metrics[f"moeserve:expert_load_imbalance{{layer={layer}}}"] for layer in MOE_LAYERS]


def stream(url: str, prompts: list[list[int]], start: threading.Barrier, results: dict, key: int) -> None:
    """One streamed greedy completion of several prompts; results[key] = [(text, finish_reason)]
    per prompt, or the exception."""
    body = {"model": "tiny", "prompt": prompts, "max_tokens": B_TOKENS, "stream": True, **GREEDY}
    try:
        start.wait(30)
        texts: list[list[str]] = [[] for _ in prompts]
        finishes: list[str | None] = [None] * len(prompts)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    texts[choice["index"]].append(choice["text"])
                    finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
        results[key] = [("".join(t), f) for t, f in zip(texts, finishes)]
    except Exception as exc:  # noqa: BLE001 - reported by the test, with the others' outcomes
        results[key] = exc


def test_metrics_show_the_imbalance_falling_after_a_live_rebalance(skewed_checkpoint: Path, tmp_path: Path) -> None:
    args = [
        "--model",
        str(skewed_checkpoint),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "32MiB",
        "--ep",
        str(EP),
        "--num-redundant-experts",
        str(NUM_EXPERTS // 4),
        "--enable-eplb",
        "--per-expert-metrics",
        "--eplb-window-steps",
        str(WINDOW),
        "--eplb-interval-steps",
        str(INTERVAL),
        "--debug-min-step-time-ms",
        str(STEP_FLOOR_MS),
        # Prompts prefill in one or two steps, as the budget above counts: the slo policy, under
        # a step floor longer than its TBT target, would prefill one KV block per step.
        "--scheduling-policy",
        "fcfs",
    ]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        server.wait_healthy()
        # Phase A: 16 requests at once (one HTTP request of 16 prompts), 30 steps; their first
        # step alone routes over IMBALANCE_MIN_ROWS rows (16 x 48+ tokens x 3 experts).
        body = {"model": "tiny", "prompt": token_prompts(16, 2, 48, 64), "max_tokens": A_TOKENS}
        short = httpx.post(f"{server.url}/v1/completions", json={**body, **GREEDY}, timeout=60)
        assert short.status_code == 200, short.text
        assert [c["finish_reason"] for c in short.json()["choices"]] == ["length"] * 16
        before = server.metrics()
        assert before["moeserve:eplb_rebalances_total"] == 0
        contiguous = layer_imbalance(before)

        # Phase B: 64 sequences in 4 streamed requests (few requests: they arrive together).
        prompts = token_prompts(B_SEQUENCES, 1, 2, 30)
        batches = [prompts[i : i + 16] for i in range(0, len(prompts), 16)]
        start, results = threading.Barrier(len(batches)), {}
        threads = [
            threading.Thread(target=stream, args=(server.url, batch, start, results, i), daemon=True)
            for i, batch in enumerate(batches)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = server.metrics()
        log = server.log()
    finally:
        assert server.stop() == 0, server.log()

    failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert len(results) == len(batches) and not failed, failed
    outputs = [out for i in range(len(batches)) for out in results[i]]
    assert [finish for _, finish in outputs] == ["length"] * len(prompts)
    rebalanced = layer_imbalance(after)
    seconds = after["moeserve:eplb_last_rebalance_seconds"]
    moved = after["moeserve:eplb_moved_bytes_total"]
    print(
        f"\n/metrics expert_load_imbalance per MoE layer: {[round(v, 3) for v in contiguous]} before "
        f"(mean {mean(contiguous):.3f}), {[round(v, 3) for v in rebalanced]} after (mean {mean(rebalanced):.3f}); "
        f"{after['moeserve:eplb_rebalances_total']:.0f} rebalance(s), the last: "
        f"{after['moeserve:eplb_moved_experts_total']:.0f} slots, {moved / 2**20:.2f} MiB moved, "
        f"{seconds * 1e3:.1f} ms, planned max/mean "
        f"{after['moeserve:eplb_last_rebalance_imbalance{over=mean,when=before}']:.3f} -> "
        f"{after['moeserve:eplb_last_rebalance_imbalance{over=mean,when=after}']:.3f}"
    )
    assert mean(contiguous) > 1.3
    assert after["moeserve:eplb_rebalances_total"] == 1, "one rebalance, at step INTERVAL (see the step budget)"
    assert f"rebalanced experts at step {INTERVAL}:" in log
    assert moved > 0 and after["moeserve:eplb_moved_experts_total"] > 0 and seconds > 0
    assert mean(rebalanced) <= 1.15 and mean(rebalanced) < mean(contiguous) - 0.2

    # The same prompts in one process without EPLB: the same greedy text. On one thread: with two
    # on a busy machine the reference ran 18x slower (its threads wait on each other).
    greedy = SamplingParams(max_tokens=B_TOKENS, temperature=0.0, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(str(skewed_checkpoint), max_model_len=MAX_MODEL_LEN, kv_cache_memory=32 * 2**20) as llm:
            reference = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    assert [text for text, _ in outputs] == [o.outputs[0].text for o in reference]
