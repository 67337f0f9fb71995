"""A heal recovers quantized experts: one of four ranks is killed mid-decode in an engine serving
an FP8 block-quantized checkpoint (with redundant experts, so a survivor takes some lost experts
from a surviving replica and reads the others), an MXFP4 one and an INT4 one (every lost expert
read from the checkpoint), and an NVFP4 one (with redundant experts). The stored bytes and their
scales must arrive together and in the loader's layout: every greedy output equals one
process's, and every KV block comes back."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import quantize_fp8, quantize_int4, quantize_mxfp4, quantize_nvfp4
from moeserve.engine.stats import IterationStats

ENGINE = dict(max_model_len=64, block_size=8, kv_cache_blocks=96)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
VICTIM = 2  # with 4 redundant experts its slots hold 6, 7, 0: 0 has a replica on rank 0, 6 and 7 none


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (4, 17, 9, 2)]


class DecodeSteps:
    def __init__(self) -> None:
        self.count = 0

    def record(self, stats: IterationStats) -> None:
        self.count += stats.num_generation_tokens > 0


@pytest.mark.parametrize(("kind", "redundant"), [("fp8", 4), ("mxfp4", 0), ("int4", 0), ("nvfp4", 4)])
def test_a_heal_recovers_quantized_experts(make_checkpoint, tmp_path, kind, redundant) -> None:
    if kind == "fp8":
        folder = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=8), tmp_path / kind)
        quantize_fp8.quantize_checkpoint(folder, (16, 16))  # several scale blocks per expert
    elif kind in ("int4", "nvfp4"):
        folder = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=8), tmp_path / kind)
        (quantize_int4 if kind == "int4" else quantize_nvfp4).quantize_checkpoint(folder)
    else:
        folder = shutil.copytree(make_checkpoint("gpt_oss", 5, num_local_experts=8), tmp_path / kind)
        quantize_mxfp4.quantize_checkpoint(folder)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)]
    steps = DecodeSteps()
    llm = LLM(
        str(folder), ep=4, num_redundant_experts=redundant, on_rank_failure="heal", rank_restarts=0,
        heartbeat_timeout_s=1.5, stat_loggers=[steps], **ENGINE,
    )  # fmt: skip
    core = llm.engine.core
    pid = core.executor.rank_pids()[VICTIM]

    def kill_mid_decode() -> None:
        while steps.count < 5:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill_mid_decode, daemon=True)
    thread.start()
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        thread.join(5)
        (heal,) = core.heals
        assert heal.lost_ranks == (VICTIM,)
        assert heal.checkpoint_slots > 0 and (heal.peer_slots > 0) == (redundant > 0)
        assert got == expected
        assert core.scheduler.num_used_blocks == 0
    finally:
        llm.engine.shutdown()
