"""Prompt sources: random (needs no tokenizer), a JSON-lines file, or a ShareGPT dump.

`random` sends completions prompts as lists of token ids (OpenAI's `prompt` accepts them), so the
input length is exact for any server and no tokenizer is needed; ids are drawn uniformly from
[`RANDOM_MIN_TOKEN_ID`, vocab size), the low ids being where most vocabularies keep their
special tokens. Chat takes text only, so there `random` builds a text of random words, about one
token each; the server's usage tells the real count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RANDOM_MIN_TOKEN_ID = 10
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea"
).split()


@dataclass(frozen=True)
class Prompt:
    """One request's input and how many tokens to ask for."""

    prompt: str | list[int]
    """Text, or token ids (completions endpoint only)."""
    prompt_len: int | None
    """Prompt tokens when known without asking the server (token ids), else None."""
    output_len: int
    """max_tokens of the request."""
    slo_ms: tuple[float, float] | None = None
    """(TTFT, TBT) targets in ms, sent as the request's `slo` field (`--slo-mix`); None: none sent."""


def _lengths(rng: np.random.Generator, num: int, mean: int, range_ratio: float) -> list[int]:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=num)]


def random_prompts(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int, as_text: bool
) -> list[Prompt]:
    """`num` prompts of random tokens (or random words when `as_text`), lengths drawn per prompt."""
    if vocab_size <= RANDOM_MIN_TOKEN_ID:
        raise ValueError(f"--random-vocab-size must exceed {RANDOM_MIN_TOKEN_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    inputs = _lengths(rng, num, input_len, range_ratio)
    outputs = _lengths(rng, num, output_len, range_ratio)
    prompts = []
    for n_in, n_out in zip(inputs, outputs):
        if as_text:
            words = rng.choice(len(_WORDS), size=n_in)
            prompts.append(Prompt(" ".join(_WORDS[w] for w in words), None, n_out))
        else:
            ids = rng.integers(RANDOM_MIN_TOKEN_ID, vocab_size, size=n_in)
            prompts.append(Prompt([int(i) for i in ids], n_in, n_out))
    return prompts


def _cycle(prompts: list[Prompt], num: int) -> list[Prompt]:
    """`num` prompts, reusing the source from its start when it holds fewer."""
    return [prompts[i % len(prompts)] for i in range(num)]


def jsonl_prompts(path: Path, num: int, default_output_len: int) -> list[Prompt]:
    """Lines of `{"prompt": text or [ids], "output_len": N}` in file order; `output_len` is optional."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt"]
                output_len = int(item.get("output_len", default_output_len))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": ..., "output_len": N}}: {e}') from None
            ids = isinstance(prompt, list)
            if (
                not (isinstance(prompt, str) or (ids and all(isinstance(t, int) for t in prompt)))
                or not prompt
                or output_len < 1
            ):
                raise ValueError(
                    f"{path}:{lineno}: prompt must be a non-empty text or list of token ids, output_len >= 1"
                )
            prompts.append(Prompt(prompt, len(prompt) if ids else None, output_len))
            if len(prompts) == num:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return _cycle(prompts, num)


def sharegpt_prompts(path: Path, num: int, seed: int, count_tokens: Callable[[str], int] | None) -> list[Prompt]:
    """First human turn as the prompt, the first reply's length as output_len, sampled with `seed`.

    Without a tokenizer the reply's length is estimated as one token per 4 characters.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            question, answer = turns[0].get("value"), turns[1].get("value")
            if isinstance(question, str) and question and isinstance(answer, str) and answer:
                pairs.append((question, answer))
    if not pairs:
        raise ValueError(f"{path}: no conversations with a prompt and a reply (ShareGPT format)")
    order = np.random.default_rng(seed).permutation(len(pairs))
    prompts = []
    for i in order[:num]:
        question, answer = pairs[i]
        output_len = count_tokens(answer) if count_tokens else math.ceil(len(answer) / 4)
        prompts.append(Prompt(question, count_tokens(question) if count_tokens else None, max(1, output_len)))
    return _cycle(prompts, num)
