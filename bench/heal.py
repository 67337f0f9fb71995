"""Lose ranks mid-generation and keep serving (`--on-rank-failure heal`): what each stage costs.

An engine at ep=N (CPU, gloo, one node) generates greedily for a batch of requests; once they are
all decoding, a rank is SIGKILLed (and, in the two-kill scenarios, a second one after the first
heal). Per heal the figures are node 0's (`HealReport`), on the monotonic clock the kill was
timed on: detection (kill -> the monitor names the rank), abort (-> the step in flight
abandoned), fence (reap the rank, survivors regroup), expert recovery (the slowest survivor),
requeue, kill -> serving again (the engine can step), and kill -> the next tokens (after the
step that recomputes every requeued request). Every output must equal the single process's greedy tokens,
every KV block must come back and the killed ranks must be reaped, or the run is marked failed.

The rejoin scenario (ep4rejoin) lets node 0 restart the killed rank (`rank_restarts`): the batch
is generated again until the restarted rank has loaded and rejoined, then once more on the full
group. Its figures: restart -> loaded, loaded -> taken in (waiting for the next step), the steps'
pause (regroup, expert slots copied back), restart -> serving; every round's outputs must equal
the single process's and the group must be back to ep ranks.

    python bench/heal.py [--requests 32] [--max-tokens 48] [--scenarios ep4,ep8x2,ep4r4,ep4rejoin]

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
    restarts: int = 0
    """Restarts node 0 may give each killed rank (the rejoin scenario); 0 keeps the heal figures
    free of a restarted rank loading beside them."""


SCENARIOS = {
    "ep4": Scenario("ep4", 4, (2,)),
    "ep8x2": Scenario("ep8x2", 8, (2, 5)),
    "ep4r4": Scenario("ep4r4", 4, (0,), redundant=4),  # rank 0 held experts 0-4; rank 3 replicas of 0-3
    "ep4rejoin": Scenario("ep4rejoin", 4, (2,), restarts=1),
}
MAX_ROUNDS = 12  # batches generated while waiting for the restarted rank to rejoin


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
        rank_restarts=scenario.restarts,
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
    reaped = all(is_reaped(pids[victim]) for victim in scenario.kills)
    rejoin = rejoin_rounds(llm, batch, params, expected) if scenario.restarts else None
    blocks_used = core.scheduler.num_used_blocks
    llm.engine.shutdown()
    ok = all(equal) and blocks_used == 0 and reaped and len(heals) == len(scenario.kills)
    result = {
        **asdict(scenario),
        "ok": ok and (rejoin is None or rejoin["ok"]),
        "outputs_equal_single_process": f"{sum(equal)}/{len(equal)}",
        "kv_blocks_left": blocks_used,
        "killed_ranks_reaped": reaped,
        "generate_s": round(elapsed, 2),
        "heals": heals,
    }
    if rejoin is not None:
        result["rejoin"] = rejoin
    return result


def rejoin_rounds(llm: LLM, batch: list[dict], params: SamplingParams, expected: list) -> dict:
    """Generate the batch again until the restarted rank rejoined, then once more on the full
    group; every round's outputs must equal the single process's."""
    core = llm.engine.core
    rounds, equal, after = 0, True, 0
    while rounds < MAX_ROUNDS and after < 1:
        if core.rejoins:
            after += 1  # this round runs on the group with the rank back from its first step
        outputs = llm.generate(batch, params, use_tqdm=False)
        rounds += 1
        equal = equal and all(list(o.outputs[0].token_ids) == list(e) for o, e in zip(outputs, expected))
    if not core.rejoins:
        return {"ok": False, "rounds": rounds, "why": "the restarted rank never rejoined"}
    r = core.rejoins[0]
    return {
        "ok": equal and core.executor.world == len(core.executor.rank_pids()) == r.ranks_now,
        "rounds": rounds,
        "outputs_equal_single_process_every_round": equal,
        "ranks": list(r.ranks),
        "ranks_now": r.ranks_now,
        "restart_to_loaded_s": round(r.load_s, 4),
        "loaded_to_next_step_s": round(r.wait_s, 4),
        "pause_s": round(r.pause_s, 4),
        "regroup_s": round(r.regroup_s, 4),
        "expert_slots_s": round(r.experts_s, 4),
        "restart_to_serving_s": round(r.total_s, 4),
        "slots_from_other_ranks": r.peer_slots,
        "slots_from_checkpoint": r.checkpoint_slots,
        "moved_mib": round(r.moved_bytes / 2**20, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--scenarios", default="ep4,ep8x2,ep4r4,ep4rejoin", help=f"comma-separated, of {', '.join(SCENARIOS)}"
    )
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
