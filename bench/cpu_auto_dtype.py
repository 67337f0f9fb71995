"""Prefill speed of the demo model on CPU: `--dtype bfloat16` (its checkpoint's dtype) vs `--dtype auto`
(and vs `--dtype float32`, which tells whether `auto`'s choice is the faster one on this CPU).

    python bench/cpu_auto_dtype.py [--prompts 8] [--prompt-len 128] [--rounds 5]

Both engines live in this process and take turns, round by round, on the same prompts (each a
prefill of `--prompt-len` tokens and one sampled token), so machine noise hits both alike. On a
CPU without bf16 instructions `auto` computes in float32; on one with them `auto` is bf16 too
and the ratio should be about 1. Reports prompt tokens/s per round and the median of the
per-round ratios; writes bench/results/cpu_auto_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.cpu_features import cpu_has_native_bf16  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def prefill_tokens_per_s(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(len(p["prompt_token_ids"]) for p in prompts) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # no prefix cache: every round must compute its prompts, not find them cached from the last
    options = dict(
        device="cpu", max_model_len=args.prompt_len + 8, max_num_seqs=args.prompts, enable_prefix_caching=False
    )
    engines = {dtype: LLM(dtype=dtype, **options) for dtype in ("bfloat16", "float32", "auto")}
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 500, (args.prompt_len,), generator=g).tolist()}]
    prompts *= args.prompts
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():  # warm-up
        prefill_tokens_per_s(llm, prompts, params)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rates[name].append(prefill_tokens_per_s(llm, prompts, params))
    ratios = [a / b for a, b in zip(rates["auto"], rates["bfloat16"])]
    float32_ratios = [a / b for a, b in zip(rates["float32"], rates["bfloat16"])]
    result = {
        "cpu": platform.processor() or platform.machine(),
        "native_bf16": cpu_has_native_bf16(),
        "auto_dtype": str(engines["auto"].engine.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "prefix_caching": False,
        "prefill_tokens_per_s": rates,
        "auto_over_bfloat16_per_round": ratios,
        "auto_over_bfloat16_median": statistics.median(ratios),
        "float32_over_bfloat16_median": statistics.median(float32_ratios),
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_auto_dtype.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
