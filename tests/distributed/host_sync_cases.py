"""Per-rank body of `test_host_syncs_ep`: one prefill and one decode step of a real checkpoint on
an EP rank (`torch` dispatcher, tp = 1), counting host syncs in each step's model forward."""

from __future__ import annotations

import torch
from helpers.host_syncs import HostSyncCounter

from moeserve.dispatch import ExpertPlacement, create_dispatcher
from moeserve.models import load_model, model_config
from moeserve.models.layers.moe import MoEBlock
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler.scheduler import NewRequest, ScheduledRequest, SchedulerOutput
from moeserve.worker.kv_cache import allocate_kv_caches
from moeserve.worker.runner import ModelRunner

BLOCK_SIZE = 8
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def step(prompts: dict[str, list[int]], last_tokens: dict[str, int] | None) -> SchedulerOutput:
    """The prefill of every prompt (last_tokens None), or one decode step feeding each last token."""
    scheduled, new = [], []
    for i, (request_id, prompt) in enumerate(prompts.items()):
        blocks = [2 * i, 2 * i + 1]
        if last_tokens is None:
            scheduled.append(ScheduledRequest(request_id, prompt, 0, blocks, sample=True))
            new.append(NewRequest(request_id, GREEDY, prompt))
        else:
            scheduled.append(ScheduledRequest(request_id, [last_tokens[request_id]], len(prompt), blocks, sample=True))
    return SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled), [], new, [])


def run_rank(rank: int, world_size: int, folder: str, decode_bound: int) -> dict:
    """Rank r holds r + 1 sequences (so ranks dispatch different token counts). The prefill runs
    without a step bound (the uneven all-to-all, with its declared host read), the decode step
    with `decode_bound`. Returns the syncs seen inside and outside the MoE layers per step."""
    torch.set_num_threads(1)
    placement = ExpertPlacement.contiguous(model_config(folder).num_experts, world_size, rank)
    dispatcher = create_dispatcher("torch", placement)
    model = load_model(folder, torch.float32, "cpu", dispatcher)
    caches = allocate_kv_caches(model.cfg, 2 * world_size, BLOCK_SIZE, torch.float32, "cpu")
    runner = ModelRunner(model, caches, BLOCK_SIZE, eos_token_ids=(), seed=0, lockstep=True)
    prompts = {f"r{rank}-{i}": [3 + rank + i, 7, 11 + i] for i in range(rank + 1)}
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    result = {"syncs_host": {"prefill": dispatcher.syncs_host(None), "decode": dispatcher.syncs_host(decode_bound)}}
    last_tokens = None
    for name, bound in (("prefill", None), ("decode", decode_bound)):
        plan = step(prompts, last_tokens)
        with HostSyncCounter(blocks) as syncs:
            sampled = runner.execute(plan, max_tokens_per_rank=bound)
        last_tokens = {request_id: token.token_id for request_id, token in sampled.items()}
        result[name] = {"inside_moe": syncs.inside_moe, "outside_moe": syncs.outside_moe}
    result["num_moe_layers"] = len(blocks)
    return result
