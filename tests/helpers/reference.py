"""transformers as the reference: its model in float32 and its greedy tokens for one prompt."""

from __future__ import annotations

import torch


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


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
