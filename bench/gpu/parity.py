"""transformers against moeserve on one device: prefill logits and greedy tokens, per kernels backend and dtype.

    python bench/gpu/parity.py [--device cuda] [--archs ...] [--dtypes float32 bfloat16] [--kernels torch triton]

Checkpoints: tiny random-weight models written by transformers itself with the test suite's own
builder (`tests/helpers/hf_configs.py`: `hf_config`, `write_checkpoint`), one per architecture. Both sides
load the same folder, in the same dtype, on the same device.

Per (arch, dtype, kernels):
- logits: moeserve's prefill of prompts of 1, 7 and 29 tokens in one paged batch (scrambled block
  tables) against transformers' forward of each prompt: max |diff|, ||diff|| / ||ref|| and the
  share of positions whose argmax agrees;
- greedy: `LLM.generate` (greedy, ignore_eos) against transformers' `generate`: per prompt, how
  many leading tokens agree.

Verdict: float32 must match transformers' float32 (max |diff| <= 1e-3, every greedy token equal).
In bfloat16 neither side equals float32 (about 5% relative error on these models), so moeserve's
logits must be as close to transformers' float32 ones as transformers' own bfloat16 logits are
(within 1.5x). Its greedy tokens, against transformers' bfloat16 ones, are reported, not required:
the two round in a different order, and a random-weight model's near-tied logits then pick
different tokens.

Writes bench/results/parity.json (or --out) after every case. Exit 1: a case missed its verdict;
2: --device cuda without a CUDA device (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # moeserve, and the tests' checkpoint builder

RESULTS = ROOT / "bench" / "results"
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KERNELS = ("torch", "triton")
PROMPT_LENGTHS = (1, 7, 29)
BLOCK_SIZE = 4
FP32_MAX_ABS = 1e-3
BF16_SLACK = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS / "parity.json")
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    return args


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def moeserve_logits(folder: Path, dtype: torch.dtype, device: str, kernels: str, prompts: list[list[int]]):
    """Prefill logits of every prompt, all in one batch with disjoint, scrambled block tables."""
    from moeserve.models import load_model
    from moeserve.ops import attention_batch, create_ops

    model = load_model(folder, dtype, device, ops=create_ops(kernels, device))
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // BLOCK_SIZE)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))
        next_block += n
    shape = model.kv_cache_shape(next_block, BLOCK_SIZE)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
    batch = attention_batch(tables, [0] * len(prompts), [len(p) for p in prompts], BLOCK_SIZE, device)
    plan = model.ops.plan_attention(batch)
    ids = torch.tensor(sum(prompts, []), device=device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, plan, caches)).float()
    return list(logits.split([len(p) for p in prompts]))


def logit_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    diff = torch.cat([(g - w).flatten() for g, w in zip(got, want)])
    ref = torch.cat([w.flatten() for w in want])
    agree = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want))
    return {
        "max_abs": diff.abs().max().item(),
        "rel": (diff.norm() / ref.norm().clamp_min(1e-12)).item(),
        "argmax_agree": agree / sum(len(w) for w in want),
    }


def moeserve_greedy(folder: Path, dtype: str, device: str, kernels: str, prompts: list[list[int]], n: int):
    from moeserve import LLM, SamplingParams

    # max_num_seqs: on CUDA the decode graphs are captured for 1, 2 and 4 sequences only, not up to 256
    llm = LLM(str(folder), device=device, dtype=dtype, kernels=kernels, block_size=8, max_model_len=128, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def leading_agreement(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def run_case(folder: Path, dtype_name: str, device: str, kernels: str, prompts, exact, hf, n: int) -> dict:
    """`exact`: transformers' float32 (logits, tokens); `hf`: transformers' in this dtype."""
    errors = logit_errors(moeserve_logits(folder, DTYPES[dtype_name], device, kernels, prompts), exact[0])
    tokens = moeserve_greedy(folder, dtype_name, device, kernels, prompts, n)
    agree = [leading_agreement(g, w) for g, w in zip(tokens, hf[1])]
    case = {"logits": errors, "greedy_leading_agreement": agree, "greedy_tokens": n}
    if dtype_name == "float32":
        passed = errors["max_abs"] <= FP32_MAX_ABS and all(a == n for a in agree)
        rule = f"max_abs <= {FP32_MAX_ABS} and all {n} greedy tokens equal"
    else:
        case["transformers_rel"] = logit_errors(hf[0], exact[0])["rel"]
        passed = errors["rel"] <= BF16_SLACK * case["transformers_rel"] + 1e-3
        rule = f"rel <= {BF16_SLACK} x transformers' own rel in this dtype + 1e-3 (greedy tokens reported only)"
    return case | {"passed": passed, "rule": rule}


def hf_reference(folder: Path, dtype: torch.dtype, device: str, prompts: list[list[int]], n: int):
    """transformers' prefill logits of each prompt and its greedy continuation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    logits, tokens = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            logits.append(model(ids).logits[0].float())
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens.append(out[0, len(p) :].tolist())
    del model
    return logits, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu/parity.py --device cuda needs a CUDA device (none here); --device cpu runs on CPU")
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # --kernels triton on CPU: before triton is first imported
    from helpers.hf_configs import VOCAB, write_checkpoint

    from moeserve.checkpoints import train_tokenizer

    record = {
        "bench": "parity",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "prompt_lengths": list(PROMPT_LENGTHS),
        "cases": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer"
        train_tokenizer(VOCAB, tokenizer)
        prompts = prompts_for(VOCAB)
        for arch in args.archs:
            folder = write_checkpoint(Path(tmp) / arch, tokenizer, arch, seed=0)
            references = {}
            for dtype_name in dict.fromkeys(["float32", *args.dtypes]):
                try:
                    references[dtype_name] = hf_reference(
                        folder, DTYPES[dtype_name], args.device, prompts, args.max_tokens
                    )
                except Exception as e:  # noqa: BLE001 - recorded; the other architectures still run
                    case = {"arch": arch, "dtype": dtype_name, "kernels": "transformers", "passed": False}
                    record["cases"].append(case | {"error": f"transformers: {type(e).__name__}: {e}"})
                    print(_line(record["cases"][-1]), flush=True)
            for dtype_name in args.dtypes:
                if "float32" not in references or dtype_name not in references:
                    continue
                exact, hf = references["float32"], references[dtype_name]
                for kernels in args.kernels:
                    case = {"arch": arch, "dtype": dtype_name, "kernels": kernels}
                    started = time.perf_counter()
                    try:
                        case |= run_case(folder, dtype_name, args.device, kernels, prompts, exact, hf, args.max_tokens)
                    except Exception as e:  # noqa: BLE001 - recorded; the other cases still run
                        error = f"{type(e).__name__}: {e}"
                        case |= {"passed": False, "error": error, "traceback": traceback.format_exc()[-3000:]}
                    case["seconds"] = time.perf_counter() - started
                    record["cases"].append(case)
                    record["passed"] = all(c["passed"] for c in record["cases"])
                    args.out.write_text(json.dumps(record, indent=2) + "\n")
                    print(_line(case), flush=True)
    record["passed"] = bool(record["cases"]) and all(c["passed"] for c in record["cases"])
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if record["passed"] else 1


def _line(case: dict) -> str:
    head = f"{case['arch']:12s} {case['dtype']:9s} {case['kernels']:7s} {'ok  ' if case['passed'] else 'FAIL'}"
    if "error" in case:
        return f"{head} {case['error']}"
    e = case["logits"]
    own = f" (transformers {case['transformers_rel']:.2e})" if "transformers_rel" in case else ""
    return (
        f"{head} logits max|d| {e['max_abs']:.2e} rel {e['rel']:.2e}{own} argmax {e['argmax_agree']:.0%}  "
        f"greedy agree {case['greedy_leading_agreement']} of {case['greedy_tokens']}"
    )


if __name__ == "__main__":
    sys.exit(main())
