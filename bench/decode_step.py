"""Decode step time of a mid-size MoE model on the GPU, against its HBM roofline and transformers.

    python bench/decode_step.py [--batches 1 16 64 256] [--context 512] [--steps 32]

Model: a random-weight Qwen3-MoE written by `make-model` (8 layers, hidden 2048, 64 experts,
top-8, expert intermediate 768, 16 heads / 4 KV heads of 128, bf16), served by the engine with
`--kernels triton` and with `--kernels torch`, both on the GPU. For each batch size B: B requests
with `--context` prompt tokens decode `--steps` tokens each (ignore_eos); the decode step time is
the median engine step after the first two (every prompt is prefilled in the first step).

Roofline: the bytes one decode step must read from HBM: attention and dense weights once, the
experts the step's B*8 routings touch (expected distinct experts of 64 under uniform routing),
the embedding rows and the LM head, and every sequence's KV cache; divided by a large
device-to-device copy's bandwidth measured in the same run. Reported as step time / roofline.

Baseline: transformers' `generate` on the same checkpoint and GPU (bf16, static batch, greedy),
tokens/s against the engine's. Writes bench/results/decode_step.json (or --out) naming the device,
after each batch size. Without CUDA: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.checkpoints import MakeModelSpec  # noqa: E402
from moeserve.config import ModelConfig  # noqa: E402
from moeserve.models import model_config  # noqa: E402
from moeserve.worker.kv_cache import bytes_per_block  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SPEC = dict(
    arch="qwen3_moe",
    layers=8,
    hidden=2048,
    experts=64,
    top_k=8,
    heads=16,
    kv_heads=4,
    head_dim=128,
    moe_intermediate=768,
    dtype="bfloat16",
    max_position_embeddings=4096,
)


def expected_distinct_experts(num_experts: int, picks: int) -> float:
    """Expected number of distinct experts hit by `picks` uniform draws (without replacement per token
    is ignored: an upper bound close to it for picks << experts^2)."""
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** picks)


def step_bytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> float:
    """HBM bytes one decode step of `batch` sequences at `context` tokens must read."""
    size = dtype.itemsize
    h, layers = cfg.hidden_size, cfg.num_layers
    attention = (h * cfg.num_heads * cfg.head_dim * 2 + h * cfg.num_kv_heads * cfg.head_dim * 2) * size
    expert = 3 * h * cfg.moe_intermediate_size * size
    experts_touched = expected_distinct_experts(cfg.num_experts, batch * cfg.router.top_k)
    router = h * cfg.num_experts * size
    per_layer = attention + router + experts_touched * expert
    head = cfg.vocab_size * h * size + batch * h * size
    kv = batch * context * bytes_per_block(cfg, 1, dtype)  # block of one token: every layer's K and V
    return layers * per_layer + head + kv


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * src.numel() / statistics.median(times) / 1e9


def engine_decode_step_s(folder: Path, kernels: str, batch: int, context: int, steps: int) -> float:
    """Median wall time of the engine's steps once every sequence decodes."""
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="bfloat16",
        kernels=kernels,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch * context),
        max_model_len=context + steps + 8,
        kv_cache_memory=8 << 30,
    )
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (context,), generator=g).tolist()} for _ in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up: kernel compiles
    engine.add_requests([(p, params) for p in prompts])
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    llm.shutdown()
    return statistics.median(times[2:])


def transformers_tokens_per_s(folder: Path, batch: int, context: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(10, 1000, (batch, context), device="cuda")
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - started)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_step.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_step.py needs a CUDA device; none here", file=sys.stderr)
        return 2
    from moeserve.checkpoints import make_model  # here: it imports transformers' modeling, parsing flags needs none

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(MakeModelSpec(**SPEC), Path(tmp) / "model")
        cfg = model_config(folder)
        bandwidth = copy_bandwidth()
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "host": platform.node(),
            "copy_gb_per_s": bandwidth,
            "model": SPEC,
            "context": args.context,
            "steps": args.steps,
            "rows": [],
        }
        for batch in args.batches:
            roofline = step_bytes(cfg, batch, args.context, torch.bfloat16) / (bandwidth * 1e9)
            row = {"batch": batch, "roofline_ms": roofline * 1e3}
            for kernels in ("triton", "torch"):
                step = engine_decode_step_s(folder, kernels, batch, args.context, args.steps)
                row[f"{kernels}_step_ms"] = step * 1e3
                row[f"{kernels}_vs_roofline"] = step / roofline
                row[f"{kernels}_tokens_per_s"] = batch / step
            row["transformers_tokens_per_s"] = transformers_tokens_per_s(folder, batch, args.context, args.steps)
            row["triton_vs_transformers"] = row["triton_tokens_per_s"] / row["transformers_tokens_per_s"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")  # after each batch: a run cut short keeps these
    return 0


if __name__ == "__main__":
    sys.exit(main())
