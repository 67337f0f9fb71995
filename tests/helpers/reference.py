"""transformers as the reference: its model (in float32 unless asked), its greedy tokens for one
prompt, and the largest prefill logit gap between it and a loaded moeserve model."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_model(folder, dtype: torch.dtype = torch.float32):
    """transformers' model of `folder` in `dtype` (float32 unless asked). An MXFP4 checkpoint
    (gpt-oss) is dequantized by transformers' own code, as it does on a machine without its MXFP4
    kernels. In bf16/fp16 its experts run as its per-expert loop: its grouped_mm path crashes on
    an expert width whose rows are not a multiple of 16 bytes (28 bf16 values)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quant = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quant.get("quant_method") == "mxfp4" else {}
    if dtype != torch.float32:
        extra["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval()


def hf_greedy_tokens(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Exactly `num_tokens` greedy tokens after `prompt` (EOS does not stop it, as ignore_eos)."""
    ids = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return ids[0, len(prompt) :].tolist()


def prefill_logits(model, batch: list[list[int]]) -> torch.Tensor:
    """A loaded moeserve model's logits at every position of one paged prefill of `batch` (its KV
    cache allocated from its layers' specs, in its own dtype, on its device; a hybrid's state
    layers hold each sequence in its own state slot)."""
    from moeserve.ops import attention_batch
    from moeserve.ops.state_batch import LinearState, StateBatch, StateStep
    from moeserve.worker.kv_cache import allocate_kv_caches

    device = model.embed_tokens.device
    block_size, tables, next_block = 4, [], 0
    for p in batch:
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    caches = allocate_kv_caches(
        model.cfg, next_block, block_size, model.dtype, device, model.tp.size, num_state_slots=len(batch)
    )
    states = StateBatch(tuple(range(len(batch))), tuple(map(len, batch)), (False,) * len(batch))
    bound = [StateStep(c, states) if isinstance(c, LinearState) else c for c in caches]
    plan = model.ops.plan_attention(
        attention_batch(tables, [0] * len(batch), [len(p) for p in batch], block_size, device)
    )
    with torch.inference_mode():
        positions = torch.cat([torch.arange(len(p)) for p in batch]).to(device)
        return model.compute_logits(model(torch.tensor(sum(batch, []), device=device), positions, plan, bound))


def max_prefill_dlogit(ours, ref_model, batch: list[list[int]]) -> float:
    """Largest |logit difference| over every prompt's prefill, ours (one batch, its KV cache in
    its own dtype) vs transformers."""
    logits = prefill_logits(ours, batch)
    with torch.inference_mode():
        refs = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in batch])
    return (logits.float() - refs.float()).abs().max().item()
