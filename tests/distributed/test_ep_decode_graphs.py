"""Decode graphs at ep = 2 (emulated capture, `torch` dispatcher over gloo): every rank pads to the
size of the step-global bound and replays alike, and the greedy tokens equal one eager process."""

from __future__ import annotations

import logging

import torch

from moeserve import LLM, SamplingParams

ENGINE = dict(max_model_len=48, block_size=8, kv_cache_blocks=48)


def test_ep2_graph_replays_give_the_single_process_tokens(make_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="moeserve.executor.multiproc")
    folder = make_checkpoint("qwen3_moe", 5, num_experts=8)
    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in (1, 3, 17, 5, 9)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 4, 6, 8, 10)]
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **ENGINE).generate(prompts, params, use_tqdm=False)]
    with LLM(str(folder), ep=2, emulate_cuda_graphs=True, cuda_graph_sizes=(1, 2, 4), **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    loads = [r.getMessage() for r in caplog.records if "decode graphs" in r.getMessage()]
    assert len(loads) == 2 and all(m.endswith("decode graphs [1, 2, 4]") for m in loads), loads
