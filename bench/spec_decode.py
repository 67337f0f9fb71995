"""What speculative decoding buys, n-gram drafts on a repetitive workload and MTP drafts on a
plain one, against no speculation.

Workload: each request's prompt is a random 24-token passage quoted four times (a document under
discussion, code being edited), 8 requests at once, 64 greedy tokens each. Two models of the same
shape and cost: "random" (make-model's random weights: its continuation is noise, so drafts are
rarely right and the run measures what drafting costs), and "repetitive", the same weights with
every attention output and expert down projection zeroed, so each layer still computes but adds
nothing and the next greedy token is a fixed function of the last one: outputs fall into a cycle
that prompt lookup predicts (the case it is for: text that repeats itself). For each model two
engines in this process, one with `--speculative-config '{"method": "ngram",
"num_speculative_tokens": K}'` and one without, take turns over `--repeats` rounds, each on fresh
prompts. Per round: greedy outputs must be identical; the target steps each engine took to decode
the batch (steps that gave some stream a token after its first) and the median TPOT ((e2e - TTFT)
/ (tokens - 1), per request); acceptance and the mean accepted length (tokens a drafting sequence
gained per target step, kept drafts + 1) from the engine's counters. The CPU is shared with other
work, so TPOT is noisy; the step counts are not: a TPOT speedup is reported with its range over
the rounds and claimed only where its distance from 1x exceeds that spread (`speedup`).

MTP (`{"method": "mtp", "num_speculative_tokens": K}`) runs on random prompts (nothing repeats)
with a DeepSeek-V3 checkpoint whose MTP layer is built to agree with the target (make-model
`--mtp-layers 1 --mtp-init aligned`: a copy of the target's last decoder layer reading the next
token's embedding, with the target's embedding, norm and head; see `checkpoints/mtp.py`). Its
first three layers are dense with their o_proj and down_proj zeroed after it is made: they cost
a target step what three layers cost but add nothing, so the target's last (MoE) layer computes
what a one-layer model would, which the MTP copy of it predicts at the next position exactly but
for attention to the first token. The draft then costs one layer of the target's four, as an
MTP layer costs DeepSeek-V3 one of its 62. Same rounds and measures as above.

    python bench/spec_decode.py [--repeats 3] [--requests 8] [--k 3] [--cases repetitive random mtp]

On a CPU busy with other work, run it with OMP_NUM_THREADS=1: torch's threads waiting for each
other's time slices made every step some 40x slower there. The torch thread count is recorded.

Writes bench/results/spec_decode.json (each case's counts under its drafter's name, "ngram" or
"mtp", beside "none"), which docs/speculative-decoding.md quotes through `report` at every build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.engine import LLMEngine
from moeserve.engine.stats import IterationStats
from moeserve.engine_config import EngineConfig
from moeserve.sampling_params import SamplingParams
from moeserve.spec_decode.stats import SpecDecodeStats

RESULTS = Path(__file__).parent / "results"
SPEC = MakeModelSpec(
    arch="qwen3_moe",
    layers=4,
    hidden=256,
    experts=8,
    top_k=2,
    vocab=512,
    heads=4,
    kv_heads=2,
    head_dim=64,
    moe_intermediate=384,
    dtype="float32",
    max_position_embeddings=4096,
)
MTP_SPEC = MakeModelSpec(
    arch="deepseek_v3",
    layers=4,
    first_k_dense_replace=3,
    hidden=256,
    experts=8,
    top_k=2,
    vocab=512,
    heads=4,
    dtype="float32",
    max_position_embeddings=4096,
    mtp_layers=1,
    mtp_init="aligned",
)
MTP_SILENT_LAYERS = ("model.layers.0.", "model.layers.1.", "model.layers.2.")
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


class Counters:
    """Decoding steps and speculative decoding's counters, as /metrics adds them up."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.spec = SpecDecodeStats()

    def record(self, stats: IterationStats) -> None:
        if stats.tbts_s:  # a step that gave a running stream its next token(s)
            self.decode_steps += 1
        if stats.spec_decode is not None:
            self.spec.merge(stats.spec_decode)


def silence(model: Path, name: str, layers: tuple[str, ...] = ("model.layers.",)) -> Path:
    """A copy of `model` whose `layers` add nothing to the residual stream (attention o_proj and
    expert down_proj zeroed) but cost what they did; the MTP layers' own file is left alone.
    All layers silent: the next greedy token depends on the last token alone."""
    out = model.parent / name
    shutil.copytree(model, out)
    for shard in out.glob("model*.safetensors"):
        if shard.name == "model-mtp.safetensors":
            continue
        tensors = load_file(shard)
        for tensor_name, tensor in tensors.items():
            if tensor_name.startswith(layers) and tensor_name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
        save_file(tensors, shard, metadata={"format": "pt"})
    return out


def make_engine(model: Path, spec: dict | None, counters: Counters) -> LLMEngine:
    config = EngineConfig.from_options(model=str(model), max_model_len=1024, speculative_config=spec)
    return LLMEngine(config, stat_loggers=[counters])


def quoted_prompts(rng: random.Random, requests: int) -> list[list[int]]:
    passages = [[rng.randrange(5, SPEC.vocab) for _ in range(24)] for _ in range(requests)]
    return [passage * 4 for passage in passages]


def random_prompts(rng: random.Random, requests: int) -> list[list[int]]:
    return [[rng.randrange(5, MTP_SPEC.vocab) for _ in range(32)] for _ in range(requests)]


def run(engine: LLMEngine, batch: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """All of `batch` at once; (each request's tokens, each request's TPOT in seconds)."""
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in batch]
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    tpots = []
    for i in ids:
        m, n = done[i].metrics, len(done[i].outputs[0].token_ids)
        tpots.append((m.e2e_s - m.ttft_s) / (n - 1))
    return [done[i].outputs[0].token_ids for i in ids], tpots


def compare(model: Path, method: dict, prompts, repeats: int, requests: int, rng: random.Random) -> dict:
    """Alternating rounds of the two engines on `model`, one drafting with `method` (its rows and
    counts under the drafter's name, "ngram" or "mtp"), the other not ("none"), on batches of
    `prompts(rng, requests)`; the summary of them."""
    drafter = method["method"]
    modes = {drafter: method, "none": None}
    counters = {mode: Counters() for mode in modes}
    engines = {mode: make_engine(model, spec, counters[mode]) for mode, spec in modes.items()}
    for engine in engines.values():  # warm-up, unmeasured
        run(engine, prompts(rng, 2))
    counters[drafter].spec = SpecDecodeStats()
    rounds = []
    for repeat in range(repeats):
        batch = prompts(rng, requests)
        order = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
        tokens, tpots, steps = {}, {}, {}
        for mode in order:
            before = counters[mode].decode_steps
            tokens[mode], tpots[mode] = run(engines[mode], batch)
            steps[mode] = counters[mode].decode_steps - before
        tpot_ms = {mode: 1000 * statistics.median(tpots[mode]) for mode in modes}
        rounds.append(
            {
                "first": order[0],
                "outputs_identical": tokens[drafter] == tokens["none"],
                "target_steps": steps,
                "tpot_median_ms": tpot_ms,
                "tpot_speedup": tpot_ms["none"] / tpot_ms[drafter],
            }
        )
        print(f"{model.name} round {repeat}: {json.dumps(rounds[-1])}", flush=True)
    for engine in engines.values():
        engine.shutdown()
    spec = counters[drafter].spec
    return {
        "drafter": drafter,
        "rounds": rounds,
        "outputs_identical": all(r["outputs_identical"] for r in rounds),
        "target_steps": {mode: sum(r["target_steps"][mode] for r in rounds) for mode in modes},
        "tpot_speedup": speedup([r["tpot_speedup"] for r in rounds]),
        "acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "mean_accepted_length": spec.mean_accepted_length,
        "accepted_per_position": spec.accepted_per_position,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
    }


MIN_ROUNDS_FOR_A_CLAIM = 3
"""With fewer rounds their spread says too little of the noise to weigh a ratio against it."""


def speedup(per_round: list[float]) -> dict:
    """The TPOT ratio (no drafts / drafts) across rounds: its median, its spread (max - min over
    the rounds) and the verdict, "faster" or "slower" only where the median's distance from 1x
    exceeds the spread (and there are enough rounds to have one), else "within noise"."""
    median, low, high = statistics.median(per_round), min(per_round), max(per_round)
    spread = high - low
    verdict = "within noise"
    if len(per_round) >= MIN_ROUNDS_FOR_A_CLAIM and abs(median - 1) > spread:
        verdict = "faster" if median > 1 else "slower"
    return {"per_round": per_round, "median": median, "min": low, "max": high, "spread": spread, "verdict": verdict}


CASES = {
    "repetitive": "n-gram drafts on a model whose layers add nothing, so its greedy output cycles "
    "(the text prompt lookup is for)",
    "random": "n-gram drafts on random weights: drafts are rarely right, so it measures what drafting costs",
    "mtp": "MTP drafts from a layer built to agree with the target, on random prompts",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp())
    rng = random.Random(args.seed)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    mtp = {"method": "mtp", "num_speculative_tokens": args.k}
    load_start = os.getloadavg()[0]
    cases = {}
    for case in args.cases:
        if case == "mtp":
            model = silence(make_model(MTP_SPEC, root / "mtp-made"), "mtp", MTP_SILENT_LAYERS)
            summary = compare(model, mtp, random_prompts, args.repeats, args.requests, rng)
        else:
            if not (root / "random").exists():
                make_model(SPEC, root / "random")
            model = silence(root / "random", "repetitive") if case == "repetitive" else root / "random"
            summary = compare(model, ngram, quoted_prompts, args.repeats, args.requests, rng)
        cases[case] = {"about": CASES[case], **summary}
    result = {
        "device": (
            f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other work; "
            f"{torch.get_num_threads()} torch thread(s)"
        ),
        "load_average_1m": {"start": round(load_start, 1), "end": round(os.getloadavg()[0], 1)},
        "model": (
            f"ngram: qwen3_moe, {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.experts} experts "
            f"top-{SPEC.top_k}, float32: random weights, and the same with o_proj and down_proj zeroed "
            f"(repetitive); mtp: deepseek_v3, {MTP_SPEC.layers} layers (the first 3 dense and silent), hidden "
            f"{MTP_SPEC.hidden}, {MTP_SPEC.experts} experts top-{MTP_SPEC.top_k}, float32, one aligned MTP layer"
        ),
        "load": (
            f"{args.requests} requests at once, {GREEDY.max_tokens} greedy tokens out; ngram: each prompt a "
            f"24-token passage quoted 4 times, k={args.k}, prompt_lookup 1..4; mtp: random 32-token prompts, "
            f"k={args.k}"
        ),
        "repeats": args.repeats,
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(report(result))


def report(result: dict) -> str:
    """The results as Markdown: what the script prints, and what docs/speculative-decoding.md
    shows, rendered from the committed results file when the site is built (docs/hooks/reference.py),
    so the page always quotes the file. Per case: outputs identical or not, drafts kept (overall
    and by position), tokens a drafting sequence gained per target step, the batch's target steps
    with and without drafts over all rounds, and the TPOT speedup with its range and verdict."""
    load = result["load_average_1m"]
    lines = [
        f"On {result['device']} (1-minute load average {load['start']} at the start, {load['end']} at the end), "
        f"{result['repeats']} rounds per case; {result['load']}. Models: {result['model']}.",
        "",
        "| case | drafts kept | kept at positions 1..k | tokens per drafting step | target steps, drafts / none "
        "| outputs identical | TPOT speedup: median (range over rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, r in result["cases"].items():
        steps, tpot = r["target_steps"], r["tpot_speedup"]
        lines.append(
            f"| {case} (`{r['drafter']}`): {r['about']} | {r['acceptance_rate']:.0%} of {r['num_draft_tokens']} | "
            f"{', '.join(map(str, r['accepted_per_position']))} | {r['mean_accepted_length']:.2f} | "
            f"{steps[r['drafter']]} / {steps['none']} | {'yes' if r['outputs_identical'] else 'NO'} | "
            f"{tpot['median']:.2f}x ({tpot['min']:.2f}x to {tpot['max']:.2f}x): {tpot['verdict']} |"
        )
    lines += [
        "",
        f"A TPOT speedup is claimed (faster or slower) only where its median's distance from 1x exceeds its spread "
        f"over the rounds (max - min), with at least {MIN_ROUNDS_FOR_A_CLAIM} rounds; otherwise it reads "
        '"within noise". Target steps and acceptance do not depend on the load of the machine; TPOT does.',
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
