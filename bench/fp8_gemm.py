"""Block-scaled FP8 (w8a8) GEMMs against the bf16 path, side by side, on real shapes.

    python bench/fp8_gemm.py [--tokens 1 16 128 1024 4096] [--moe-tokens 1 64 1024] [--reps 25]

Linear (DeepSeek-V3's projections): `w8a8_linear` (per-token-group quantization of x, then the
FP8 GEMM) against `F.linear` on bf16 weights, which is what kernels=triton runs for a bf16
checkpoint's linears. Fused MoE (bench/moe_kernel.py's shapes): `fused_moe_w8a8` against
`fused_moe` in bf16, on the same routing and alignment (the alignment is not timed).

Both paths of a row are timed in the same loop, alternately (which goes first alternates too),
each repeat with a cold L2; the row reports both medians and `speedup` = bf16 time / FP8 time,
the only figure to compare across runs. `rel_err` is the FP8 output's relative distance from
the bf16 output: what quantizing weights and activations to e4m3 costs on random data.
Weights are random with a 1/sqrt(in) spread, quantized by `fp8_format.quantize` as an FP8
checkpoint's are.

Writes bench/results/fp8_gemm.json, naming the device. Without CUDA: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere, moeserve installed or not
sys.path.insert(0, str(ROOT / "bench"))  # its sibling moe_kernel, also when imported by the runbook

# The bf16 bench's MoE shapes, L2 flush and timer, so that the two benches compare.
from moe_kernel import L2_FLUSH_BYTES, SHAPES, cold_us, rel_err  # noqa: E402

from moeserve.fp8_format import BlockFP8Weight, quantize  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TOKENS = (1, 16, 128, 1024, 4096)
MOE_TOKENS = (1, 64, 1024)
BLOCK = (128, 128)


@dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int


LINEARS = (
    LinearShape("q_a_proj", 7168, 1536),
    LinearShape("q_b_proj", 1536, 24576),
    LinearShape("o_proj", 16384, 7168),
    LinearShape("dense_gate_up", 7168, 36864),
    LinearShape("dense_down", 18432, 7168),
)


def fp8_of(weight: torch.Tensor, parts: int = 1) -> BlockFP8Weight:
    """`weight [..., parts * rows, cols]` as an FP8 checkpoint stores it: each part (and each
    stacked expert) quantized by itself."""
    *lead, all_rows, cols = weight.shape
    flat = weight.reshape(-1, parts, all_rows // parts, cols)
    tiles = [[quantize(part, BLOCK) for part in matrix] for matrix in flat]
    data = torch.stack([torch.cat([q for q, _ in row]) for row in tiles])
    scales = torch.stack([torch.stack([s for _, s in row]) for row in tiles])
    return BlockFP8Weight(data.reshape(weight.shape), scales.reshape(*lead, parts, *scales.shape[2:]), BLOCK)


def time_pair(
    bf16: Callable[[], object], fp8: Callable[[], object], warmup: int, reps: int, flush: torch.Tensor
) -> tuple[float, float]:
    """Median microseconds of each, measured alternately (order swapped every repeat), cold L2."""
    for _ in range(warmup):
        bf16()
        fp8()
    times: dict[str, list[float]] = {"bf16": [], "fp8": []}
    for rep in range(reps):
        order = (("bf16", bf16), ("fp8", fp8)) if rep % 2 == 0 else (("fp8", fp8), ("bf16", bf16))
        for name, fn in order:
            times[name].append(cold_us(fn, flush))
    return statistics.median(times["bf16"]), statistics.median(times["fp8"])


def row(kind: str, name: str, tokens: int, bf16_us: float, fp8_us: float, err: float, **extra) -> dict:
    print(
        f"{kind:6s} {name:16s} T={tokens:5d}  bf16 {bf16_us:9.1f} us  fp8 {fp8_us:9.1f} us  "
        f"speedup {bf16_us / fp8_us:5.2f}x  rel_err {err:.1e}",
        flush=True,
    )
    speedup = bf16_us / fp8_us
    return dict(
        kind=kind, name=name, tokens=tokens, bf16_us=bf16_us, fp8_us=fp8_us, speedup=speedup, rel_err=err, **extra
    )


def bench_linears(tokens: tuple[int, ...], timer, device: torch.device) -> list[dict]:
    from moeserve.kernels.fp8_gemm import w8a8_linear

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in LINEARS:
        w = torch.randn(shape.out_features, shape.in_features, device=device, generator=gen) * shape.in_features**-0.5
        w_bf16, w_fp8 = w.to(torch.bfloat16), fp8_of(w)
        del w
        for num_tokens in tokens:
            x = torch.randn(num_tokens, shape.in_features, device=device, generator=gen, dtype=torch.bfloat16)
            err = rel_err(w8a8_linear(x, w_fp8), F.linear(x, w_bf16))
            bf16_us, fp8_us = timer(functools.partial(F.linear, x, w_bf16), functools.partial(w8a8_linear, x, w_fp8))
            rows.append(row("linear", shape.name, num_tokens, bf16_us, fp8_us, err, shape=asdict(shape)))
        del w_bf16, w_fp8
        torch.cuda.empty_cache()
    return rows


def bench_moes(tokens: tuple[int, ...], timer, device: torch.device) -> list[dict]:
    from moeserve.kernels.fused_moe import fused_moe
    from moeserve.kernels.fused_moe_fp8 import fused_moe_w8a8
    from moeserve.kernels.launch_config import block_m_for
    from moeserve.kernels.moe_align import moe_align_block_size

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in SHAPES:
        e, h, i = shape.num_experts, shape.hidden, shape.inter
        w13 = torch.randn(e, 2 * i, h, device=device, generator=gen) * h**-0.5
        w2 = torch.randn(e, h, i, device=device, generator=gen) * i**-0.5
        w13_bf16, w2_bf16, w13_fp8, w2_fp8 = w13.to(torch.bfloat16), w2.to(torch.bfloat16), fp8_of(w13, 2), fp8_of(w2)
        del w13, w2
        for num_tokens in tokens:
            hidden = torch.randn(num_tokens, h, device=device, generator=gen, dtype=torch.bfloat16)
            scores = torch.rand(num_tokens, e, device=device, generator=gen)
            topk_ids = scores.topk(shape.top_k, dim=-1).indices.to(torch.int32)
            weights = torch.rand(num_tokens * shape.top_k, device=device, generator=gen)
            aligned = moe_align_block_size(topk_ids, e, block_m_for(num_tokens, shape.top_k, e))
            bf16 = functools.partial(fused_moe, hidden, w13_bf16, w2_bf16, aligned, shape.top_k, weights)
            fp8 = functools.partial(fused_moe_w8a8, hidden, w13_fp8, w2_fp8, aligned, shape.top_k, weights)
            err = rel_err(fp8(), bf16())
            bf16_us, fp8_us = timer(bf16, fp8)
            rows.append(row("moe", shape.name, num_tokens, bf16_us, fp8_us, err, shape=asdict(shape)))
        del w13_bf16, w2_bf16, w13_fp8, w2_fp8
        torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="rows of each linear")
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=list(MOE_TOKENS), help="tokens of each MoE")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_gemm.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_gemm: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"fp8_gemm: FP8 GEMMs need an sm_89+ GPU, this is {torch.cuda.get_device_name()}", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def timer(bf16, fp8):
        return time_pair(bf16, fp8, warmup=5, reps=args.reps, flush=flush)

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "block": list(BLOCK),
        "timing": "alternating bf16/fp8 per repeat, cold L2, median of --reps; speedup = bf16_us / fp8_us",
        "results": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["results"] += bench_linears(tuple(args.tokens), timer, device)
    args.out.write_text(json.dumps(result, indent=2))  # a crash in the MoE half keeps these
    result["results"] += bench_moes(tuple(args.moe_tokens), timer, device)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
