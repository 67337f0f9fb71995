"""Fused MoE grouped GEMM vs a per-expert torch loop and torch._grouped_mm, on real expert shapes.

    python bench/moe_kernel.py [--tokens 1 8 64 256 1024 4096] [--reps 25]

Shapes (bf16): DeepSeek-V3 per rank at EP=8 (hidden 7168, expert intermediate 2048, 256/8 = 32
local experts, top-8; routing is drawn over the 32 local experts, i.e. every pair lands on this
rank), Qwen3-30B-A3B (2048, 768, 128 experts, top-8), Mixtral-8x7B (4096, 14336, 8 experts, top-2).
Routing: top-k of uniform random scores, fixed seed; pair weights random.

Every path produces the `[T*K, H]` weighted expert output of each (token, k) pair and starts from
routing already prepared (alignment for the fused kernel, sorted pair order and host-side counts
for the torch paths): the token gather, both GEMMs, SiLU-and-multiply, weighting and the scatter
are timed, the routing sort is not. `fused+align` adds moe_align_block_size, the fused path's
whole cost from `topk_ids`. Times are CUDA events around one call, the L2 flushed before
each repeat, median of repeats after warmup.

Reported per (model, tokens, path): microseconds; TFLOP/s (6 * T * K * H * I: both GEMMs of every
pair, padding excluded) and its fraction of a large bf16 GEMM's TFLOP/s measured in the same run;
weight GB/s (bytes of the distinct experts the routing touched, read once) and its fraction of a
large device-to-device copy's GB/s (read + write bytes) measured in the same run. Decode sizes are
weight-bandwidth bound, so the GB/s fraction is the one to watch there; prefill sizes the TFLOP/s one.

Writes bench/results/moe_kernel.json, naming the device. Without CUDA: one line, exit status 2.
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

from moeserve.kernels.fused_moe import fused_moe  # noqa: E402
from moeserve.kernels.launch_config import block_m_for, config_for, default_max_programs  # noqa: E402
from moeserve.kernels.moe_align import moe_align_block_size  # noqa: E402
from moeserve.ops.grouped_mlp import grouped_mlp  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TOKENS = (1, 8, 64, 256, 1024, 4096)
L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    inter: int
    num_experts: int
    top_k: int


SHAPES = (
    MoEShape("deepseek_v3_ep8", hidden=7168, inter=2048, num_experts=256 // 8, top_k=8),
    MoEShape("qwen3_30b_a3b", hidden=2048, inter=768, num_experts=128, top_k=8),
    MoEShape("mixtral_8x7b", hidden=4096, inter=14336, num_experts=8, top_k=2),
)


def moe_flops(shape: MoEShape, num_tokens: int) -> int:
    """Useful FLOPs: per pair, gate/up `[H] x [H, 2I]` and down `[I] x [I, H]`, 2 per multiply-add."""
    return 2 * num_tokens * shape.top_k * (2 * shape.inter * shape.hidden + shape.hidden * shape.inter)


def experts_touched(topk_ids: torch.Tensor, num_experts: int) -> int:
    """Distinct local experts that at least one pair is routed to."""
    flat = topk_ids.reshape(-1)
    return int(torch.unique(flat[(flat >= 0) & (flat < num_experts)]).numel())


def weight_bytes(shape: MoEShape, topk_ids: torch.Tensor, elem_bytes: int) -> int:
    """Bytes of the touched experts' w13 `[2I, H]` and w2 `[H, I]`: the least any kernel must read."""
    return experts_touched(topk_ids, shape.num_experts) * 3 * shape.inter * shape.hidden * elem_bytes


@dataclass(frozen=True)
class Routing:
    """What the torch paths start from: valid pairs sorted by expert, counts on the host."""

    top_k: int
    num_pairs: int
    order: torch.Tensor  # [N] pair ids grouped by expert
    counts: tuple[int, ...]  # [E] pairs per expert
    expert_counts: torch.Tensor  # [E] int64 pairs per expert, on the device (grouped_mlp's counts)
    sorted_weights: torch.Tensor  # [N] float32

    @classmethod
    def build(cls, topk_ids: torch.Tensor, pair_weights: torch.Tensor, num_experts: int) -> Routing:
        flat = topk_ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < num_experts)
        order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)[: int(valid.sum())]
        counts = torch.bincount(flat[order], minlength=num_experts)
        return cls(
            top_k=topk_ids.shape[1],
            num_pairs=flat.numel(),
            order=order,
            counts=tuple(counts.tolist()),
            expert_counts=counts,
            sorted_weights=pair_weights[order],
        )


def _fused_with_align(hidden, w13, w2, topk_ids, block_m, shape, weights) -> torch.Tensor:
    """The fused path including the alignment it needs each step."""
    aligned = moe_align_block_size(topk_ids, shape.num_experts, block_m)
    return fused_moe(hidden, w13, w2, aligned, shape.top_k, weights)


def torch_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Per expert: gather its rows, two GEMMs, weight, scatter (what Experts.forward does, plus gather/scatter)."""
    out = hidden.new_zeros(routing.num_pairs, hidden.shape[1])
    start = 0
    for expert, count in enumerate(routing.counts):
        if count == 0:
            continue
        pairs = routing.order[start : start + count]
        gate, up = F.linear(hidden[pairs // routing.top_k], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out[pairs] = (y.float() * routing.sorted_weights[start : start + count, None]).to(out.dtype)
        start += count
    return out


def torch_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Gather, the torch backend's `grouped_mlp` (a grouped_mm for gate/up, SiLU-and-multiply, a
    grouped_mm for down; widths padded where grouped_mm needs it), weight, scatter."""
    x = hidden[routing.order // routing.top_k]
    y = grouped_mlp(x, routing.expert_counts, w13, w2)
    out = hidden.new_zeros(routing.num_pairs, hidden.shape[1])
    out[routing.order] = (y.float() * routing.sorted_weights[:, None]).to(out.dtype)
    return out


def grouped_mm_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this torch build runs torch._grouped_mm for `dtype` on `device` (it is arch-limited)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    x = torch.zeros(16, 16, dtype=dtype, device=device)
    w = torch.zeros(2, 16, 16, dtype=dtype, device=device)
    try:
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def cold_us(fn: Callable[[], object], flush: torch.Tensor) -> float:
    """One CUDA-event time of `fn` in microseconds, after flushing the L2."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def time_us(fn: Callable[[], object], warmup: int, reps: int, flush: torch.Tensor) -> float:
    """Median CUDA-event time of `fn`, with a cold L2 each repeat."""
    for _ in range(warmup):
        fn()
    return statistics.median(cold_us(fn, flush) for _ in range(reps))


def measure_ceilings(flush: torch.Tensor, reps: int) -> dict[str, float]:
    """A large bf16 GEMM's TFLOP/s and a large device-to-device copy's GB/s, on this device now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_us = time_us(lambda: a @ b, warmup=3, reps=reps, flush=flush)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src), warmup=3, reps=reps, flush=flush)
    return {
        "gemm_tflops": 2 * n**3 / gemm_us / 1e6,
        "copy_gbps": 2 * src.numel() / copy_us / 1e3,
        "gemm_shape": [n, n, n],
        "copy_bytes": src.numel(),
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def bench_shape(
    shape: MoEShape,
    tokens: tuple[int, ...],
    ceilings: dict[str, float],
    timer: Callable[[Callable[[], object]], float],
    grouped_ok: bool,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Rows of results for one model shape; `timer(fn)` gives fn's time in microseconds."""
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (
        torch.randn(shape.num_experts, 2 * shape.inter, shape.hidden, device=device, generator=gen, dtype=dtype)
        * shape.hidden**-0.5
    )
    w2 = (
        torch.randn(shape.num_experts, shape.hidden, shape.inter, device=device, generator=gen, dtype=dtype)
        * shape.inter**-0.5
    )
    rows = []
    for num_tokens in tokens:
        hidden = torch.randn(num_tokens, shape.hidden, device=device, generator=gen, dtype=dtype)
        scores = torch.rand(num_tokens, shape.num_experts, device=device, generator=gen)
        topk_ids = scores.topk(shape.top_k, dim=-1).indices.to(torch.int32)
        weights = torch.rand(num_tokens * shape.top_k, device=device, generator=gen)
        block_m = block_m_for(num_tokens, shape.top_k, shape.num_experts)
        aligned = moe_align_block_size(topk_ids, shape.num_experts, block_m)
        routing = Routing.build(topk_ids, weights, shape.num_experts)
        paths: dict[str, Callable[[], torch.Tensor]] = {
            "fused": functools.partial(fused_moe, hidden, w13, w2, aligned, shape.top_k, weights),
            "fused+align": functools.partial(_fused_with_align, hidden, w13, w2, topk_ids, block_m, shape, weights),
            "torch_loop": functools.partial(torch_loop, hidden, w13, w2, routing),
        }
        if grouped_ok:
            paths["torch_grouped_mm"] = functools.partial(torch_grouped, hidden, w13, w2, routing)
        flops = moe_flops(shape, num_tokens)
        nbytes = weight_bytes(shape, topk_ids, w13.element_size())
        want = paths["torch_loop"]()
        for path, fn in paths.items():
            row = dict(
                model=shape.name,
                tokens=num_tokens,
                path=path,
                flops=flops,
                weight_bytes=nbytes,
                experts_touched=experts_touched(topk_ids, shape.num_experts),
            )
            if path.startswith("fused"):
                row["config"] = asdict(config_for(num_tokens, shape.top_k, shape.num_experts))
            try:  # one failing path (say an arch torch._grouped_mm rejects) must not lose the others
                err = rel_err(fn(), want)
                us = timer(fn)
            except Exception as e:  # noqa: BLE001 - recorded in the results, the run goes on
                rows.append(dict(row, error=f"{type(e).__name__}: {e}"))
                print(f"{shape.name:16s} T={num_tokens:5d} {path:17s} failed: {type(e).__name__}: {e}", flush=True)
                continue
            tflops, gbps = flops / us / 1e6, nbytes / us / 1e3
            rows.append(
                dict(
                    row,
                    us=us,
                    tflops=tflops,
                    weight_gbps=gbps,
                    frac_peak_tflops=tflops / ceilings["gemm_tflops"],
                    frac_copy_gbps=gbps / ceilings["copy_gbps"],
                    rel_err_vs_torch_loop=err,
                )
            )
            print(
                f"{shape.name:16s} T={num_tokens:5d} {path:17s} {us:10.1f} us  {tflops:7.1f} TFLOP/s "
                f"({tflops / ceilings['gemm_tflops']:6.1%})  {gbps:7.0f} GB/s ({gbps / ceilings['copy_gbps']:6.1%})"
                f"  err {err:.1e}",
                flush=True,
            )
        del hidden, aligned, routing, want, paths
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--models", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_kernel.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernel: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    ceilings = measure_ceilings(flush, args.reps)
    grouped_ok = grouped_mm_supported(torch.bfloat16, device)
    print(
        f"device {torch.cuda.get_device_name()}  bf16 GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s  "
        f"copy {ceilings['copy_gbps']:.0f} GB/s  torch._grouped_mm: {'yes' if grouped_ok else 'no'}",
        flush=True,
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "sm_count": default_max_programs(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "ceilings": ceilings,
        "torch_grouped_mm": grouped_ok,
        "shapes": [asdict(s) for s in SHAPES if s.name in args.models],
        "results": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    timer = functools.partial(time_us, warmup=5, reps=args.reps, flush=flush)
    for shape in SHAPES:
        if shape.name in args.models:
            result["results"] += bench_shape(shape, tuple(args.tokens), ceilings, timer, grouped_ok)
            args.out.write_text(json.dumps(result, indent=2))  # after each model: a crash later keeps these
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
