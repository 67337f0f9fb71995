"""What n-gram speculative decoding buys on a repetitive workload, against no speculation.

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
work, so TPOT is noisy; the step counts are not.

    python bench/spec_decode.py [--repeats 3] [--requests 8] [--k 3]

MTP is not measured: the engine does not load MTP weights yet (`"method": "mtp"` is refused).
Writes bench/results/spec_decode.json.
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


def make_repetitive(model: Path) -> Path:
    """A copy of `model` whose layers add nothing to the residual stream (attention o_proj and
    expert down_proj zeroed): the next greedy token depends on the last token alone."""
    out = model.parent / "repetitive"
    shutil.copytree(model, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
        save_file(tensors, shard, metadata={"format": "pt"})
    return out


def make_engine(model: Path, k: int | None, counters: Counters) -> LLMEngine:
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    config = EngineConfig.from_options(model=str(model), max_model_len=1024, speculative_config=spec)
    return LLMEngine(config, stat_loggers=[counters])


def prompts(rng: random.Random, requests: int) -> list[list[int]]:
    passages = [[rng.randrange(5, SPEC.vocab) for _ in range(24)] for _ in range(requests)]
    return [passage * 4 for passage in passages]


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


def compare(model: Path, k: int, repeats: int, requests: int, rng: random.Random) -> dict:
    """Alternating rounds of the two engines on `model`; the summary of them."""
    modes = {"ngram": k, "none": None}
    counters = {mode: Counters() for mode in modes}
    engines = {mode: make_engine(model, k, counters[mode]) for mode, k in modes.items()}
    for engine in engines.values():  # warm-up, unmeasured
        run(engine, prompts(rng, 2))
    counters["ngram"].spec = SpecDecodeStats()
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
                "outputs_identical": tokens["ngram"] == tokens["none"],
                "target_steps": steps,
                "tpot_median_ms": tpot_ms,
                "tpot_speedup": tpot_ms["none"] / tpot_ms["ngram"],
            }
        )
        print(f"{model.name} round {repeat}: {json.dumps(rounds[-1])}", flush=True)
    for engine in engines.values():
        engine.shutdown()
    spec = counters["ngram"].spec
    return {
        "rounds": rounds,
        "outputs_identical": all(r["outputs_identical"] for r in rounds),
        "target_steps": {mode: sum(r["target_steps"][mode] for r in rounds) for mode in modes},
        "tpot_speedup_median": statistics.median(r["tpot_speedup"] for r in rounds),
        "acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "mean_accepted_length": spec.mean_accepted_length,
        "accepted_per_position": spec.accepted_per_position,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = make_model(SPEC, Path(tempfile.mkdtemp()) / "random")
    rng = random.Random(args.seed)
    results = {
        name: compare(folder, args.k, args.repeats, args.requests, rng)
        for name, folder in (("repetitive", make_repetitive(model)), ("random", model))
    }
    result = {
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "model": (
            f"qwen3_moe, {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.experts} experts top-{SPEC.top_k}, "
            "float32: random weights, and the same with o_proj and down_proj zeroed (repetitive)"
        ),
        "load": (
            f"{args.requests} requests at once, each a 24-token passage quoted 4 times, "
            f"{GREEDY.max_tokens} greedy tokens out; ngram k={args.k}, prompt_lookup 1..4"
        ),
        "repeats": args.repeats,
        **results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
