"""Two of eight ranks lost one after the other, one killed and one frozen, during greedy decoding
in the engine: every output equals one process's, every KV block comes back, and both lost ranks
are reaped (the frozen one fenced by SIGKILL). The server-level heal tests run at ep=4; this one
holds the same promises where each survivor takes more than one lost rank's share."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch

from moeserve import LLM, SamplingParams
from moeserve.engine.stats import IterationStats

ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=160)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
LOSSES = ((2, signal.SIGKILL), (5, signal.SIGSTOP))


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (4, 19, 7, 30, 11, 2)]


class DecodeSteps:
    def __init__(self) -> None:
        self.count = 0

    def record(self, stats: IterationStats) -> None:
        self.count += stats.num_generation_tokens > 0


def is_reaped(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return True


def test_two_of_eight_ranks_lost_and_every_output_unchanged(make_checkpoint) -> None:
    folder = str(make_checkpoint("qwen3_moe", 5, num_experts=8))
    expected = [o.outputs[0].token_ids for o in LLM(folder, **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)]
    steps = DecodeSteps()
    llm = LLM(
        folder, ep=8, on_rank_failure="heal", min_ranks=4, rank_restarts=0, heartbeat_timeout_s=1.5,
        stat_loggers=[steps], **ENGINE,
    )  # fmt: skip
    core = llm.engine.core
    pids = core.executor.rank_pids()

    def lose_ranks() -> None:
        for heals, (victim, sig) in enumerate(LOSSES):
            while len(core.heals) < heals or steps.count < 5 * (heals + 1):  # mid-decode, after the last heal
                time.sleep(0.01)
            os.kill(pids[victim], sig)

    thread = threading.Thread(target=lose_ranks, daemon=True)
    thread.start()
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        thread.join(5)
        assert [sorted(report.lost_ranks) for report in core.heals] == [[victim] for victim, _ in LOSSES]
        assert core.executor.world == 6
        assert got == expected
        assert core.scheduler.num_used_blocks == 0
        assert all(is_reaped(pids[victim]) for victim, _ in LOSSES)
    finally:
        llm.engine.shutdown()
