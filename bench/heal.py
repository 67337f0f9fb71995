"""Lose ranks mid-generation and keep serving (`--on-rank-failure heal`): what each stage costs.

An engine at ep=N (CPU, gloo, one node) generates greedily for a batch of requests; once they are
all decoding, a rank is SIGKILLed (and, in the two-kill scenarios, a second one after the first
heal). Per heal the figures are node 0's (`HealReport`), on the monotonic clock the kill was
timed on: detection (kill -> the monitor names the rank), abort (-> the step in flight
abandoned), fence (reap the rank, survivors regroup), expert recovery (the slowest survivor),
requeue, kill -> serving again (the engine can step), and kill -> the next tokens (after the
step that recomputes every requeued request). Every output must equal the single process's greedy tokens,
every KV block must come back and the killed ranks must be reaped, or the run is marked failed.

    python bench/heal.py [--requests 32] [--max-tokens 48] [--scenarios ep4,ep8x2,ep4r4]

Writes bench/results/heal.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.stats import IterationStats

RESULTS = Path(__file__).parent / "results"
SPEC = MakeModelSpec(
    arch="qwen3_moe",
    layers=4,
    hidden=256,
    experts=16,
    top_k=2,
    vocab=512,
    heads=4,
    kv_heads=2,
    head_dim=64,
    moe_intermediate=256,
    dtype="float32",
    max_position_embeddings=512,
)
ENGINE = dict(max_model_len=256, block_size=16, kv_cache_blocks=256)


@dataclass(frozen=True)
class Scenario:
    name: str
    ep: int
    kills: tuple[int, ...]
    """Launch ranks to SIGKILL, one after the other (each once the previous heal is done)."""
    redundant: int = 0


SCENARIOS = {
    "ep4": Scenario("ep4", 4, (2,)),
    "ep8x2": Scenario("ep8x2", 8, (2, 5)),
    "ep4r4": Scenario("ep4r4", 4, (0,), redundant=4),  # rank 0 held experts 0-4; rank 3 replicas of 0-3
}


def prompts(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 64, (count,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, SPEC.vocab, (n,), generator=g).tolist()} for n in lengths]


class TokenTimes:
    """When each step that sampled tokens was recorded (monotonic)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def record(self, stats: IterationStats) -> None:
        if stats.num_generation_tokens:
            self.times.append(time.monotonic())

    def first_after(self, moment: float) -> float:
        return next(t for t in self.times if t > moment)


def is_reaped(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie is not reaped
    except FileNotFoundError:
        return True


def run(model: Path, scenario: Scenario, batch: list[dict], params: SamplingParams, expected: list) -> dict:
    tokens = TokenTimes()
    llm = LLM(
        str(model),
        stat_loggers=[tokens],
        ep=scenario.ep,
        on_rank_failure="heal",
        min_ranks=2,
        num_redundant_experts=scenario.redundant,
        **ENGINE,
    )
    core = llm.engine.core
    pids = core.executor.rank_pids()
    killed_at: list[float] = []

    def killer() -> None:
        time.sleep(1.0)  # every request is past its prefill by then
        for i, victim in enumerate(scenario.kills):
            while len(core.heals) < i:
                time.sleep(0.01)
            time.sleep(0.3 if i else 0.0)
            killed_at.append(time.monotonic())
            os.kill(pids[victim], signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    started = time.monotonic()
    thread.start()
    outputs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.monotonic() - started
    thread.join(10)
    heals = []
    for kill, report in zip(killed_at, core.heals):
        heals.append(
            {
                "lost_ranks": list(report.lost_ranks),
                "ranks_left": report.ranks_left,
                "detection_s": round(report.detected_at - kill, 4),
                "abort_s": round(report.abort_s, 4),
                "fence_s": round(report.fence_s, 4),
                "expert_recovery_s": round(report.experts_s, 4),
                "requeue_s": round(report.requeue_s, 4),
                "kill_to_serving_s": round(report.detected_at - kill + report.total_s, 4),
                "kill_to_next_tokens_s": round(tokens.first_after(report.detected_at + report.total_s) - kill, 4),
                "slots_from_replicas": report.peer_slots,
                "slots_from_checkpoint": report.checkpoint_slots,
                "recovered_mib": round(report.recovered_bytes / 2**20, 3),
                "requests_moved": report.moved_requests,
            }
        )
    equal = [list(o.outputs[0].token_ids) == list(e) for o, e in zip(outputs, expected)]
    blocks_used = core.scheduler.num_used_blocks
    llm.engine.shutdown()
    reaped = all(is_reaped(pids[victim]) for victim in scenario.kills)
    ok = all(equal) and blocks_used == 0 and reaped and len(heals) == len(scenario.kills)
    return {
        **asdict(scenario),
        "ok": ok,
        "outputs_equal_single_process": f"{sum(equal)}/{len(equal)}",
        "kv_blocks_left": blocks_used,
        "killed_ranks_reaped": reaped,
        "generate_s": round(elapsed, 2),
        "heals": heals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scenarios", default="ep4,ep8x2,ep4r4", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "heal.json")
    args = parser.parse_args()
    model = make_model(SPEC, Path(tempfile.mkdtemp()) / "model")
    batch = prompts(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model), **ENGINE)
    expected = [o.outputs[0].token_ids for o in reference.generate(batch, params, use_tqdm=False)]
    reference.engine.shutdown()
    runs = []
    for name in args.scenarios.split(","):
        runs.append(run(model, SCENARIOS[name], batch, params, expected))
        print(json.dumps(runs[-1]), flush=True)
    result = {
        "what": "SIGKILL ranks while greedy requests decode; heal stages per kill (node 0's monotonic clock)",
        "how": f"bench/heal.py --requests {args.requests} --max-tokens {args.max_tokens} --scenarios {args.scenarios}",
        "model": asdict(SPEC),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": round(os.getloadavg()[0], 1),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
