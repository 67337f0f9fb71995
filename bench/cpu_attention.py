"""CPU attention: the per-sequence loop the torch backend ran before against the bucketed
one-pass attention it runs now, side by side in one process.

    python bench/cpu_attention.py [--threads 1] [--rounds 7] [--reps 20] [--layers 2]

Shapes: the demo model's attention (qwen3_moe: 4 query heads, 2 KV heads of 16), a tiny
Mixtral's (4 query heads, 2 KV heads of 32) and the tests' tiny DeepSeek-V3 MLA (4 heads,
kv_lora_rank 16, rope 8, nope 16, v 12), in float32 and bfloat16. Steps: 8 and 32 decodes with
contexts drawn from 64-300 tokens, and a mixed step (a 128-token prompt, a 64-token chunk at
position 200 and 8 decodes). Block size 16, block tables scattered over the pool.

Per layer: one attention call on a plan made beforehand. The plan is made once per step and
shared by every layer, so it is timed apart, and the step ratio is (plan + layers x layer) old
over new for a model of `--layers` layers (the demo has 2). Old and new are interleaved round by
round and each reported time is the median over rounds of the mean over `--reps` calls, in this
process's CPU time (with one torch thread, the time the calls computed, which other work on a
shared machine disturbs less than the wall clock). Also timed, relative to the new path: the
same plan run through torch's fused `scaled_dot_product_attention` per bucket ("sdpa", which is
not batch-invariant with several threads, see `bucket_attention`), and the new path under other
bucket grids (`PADDED_CONTEXTS_PER_OCTAVE`), which is how the default was chosen. Writes
bench/results/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeserve.config import MLAConfig  # noqa: E402
from moeserve.ops import torch_attention  # noqa: E402
from moeserve.ops.attention import attention_batch, gather_from_cache  # noqa: E402
from moeserve.ops.torch_attention import causal_attention, mla_attention, paged_attention  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BLOCK_SIZE = 16
SCALE = 0.25
MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
SHAPES = {  # name: (query heads, KV heads, head dim); None: MLA
    "demo qwen3 4x2x16": (4, 2, 16),
    "mixtral 4x2x32": (4, 2, 32),
    "deepseek mla 4 heads": None,
}


def steps() -> dict[str, list[tuple[int, int]]]:
    """(start position, query length) per sequence."""
    gen = torch.Generator().manual_seed(0)

    def decodes(n: int) -> list[tuple[int, int]]:
        return [(c - 1, 1) for c in torch.randint(64, 301, (n,), generator=gen).tolist()]

    return {"8 decodes": decodes(8), "32 decodes": decodes(32), "mixed": [(0, 128), (200, 64), *decodes(8)]}


# ----- the baseline: main's torch backend before this change, a loop over sequences -----


def old_plan(seqs: list[tuple[int, int]], tables: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
    """Per sequence (query length, context slots), as the old `torch_attention_plan` built them."""
    out = []
    for (start, qlen), blocks in zip(seqs, tables):
        positions = torch.arange(start + qlen, dtype=torch.int64)
        table = torch.as_tensor(blocks, dtype=torch.int64)
        out.append((qlen, table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE))
    return out


def old_paged(q, k_cache, v_cache, plan) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for qlen, slots in plan:
        k, v = gather_from_cache(k_cache, slots), gather_from_cache(v_cache, slots)
        out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, SCALE)
        start += qlen
    return out


def old_mla(q_nope, q_rope, kv_cache, plan, weight) -> torch.Tensor:
    num_heads = q_nope.shape[1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    out = q.new_empty(q.shape[0], num_heads, MLA.v_head_dim)
    start = 0
    for qlen, slots in plan:
        latent, k_rope = gather_from_cache(kv_cache, slots).split([MLA.kv_lora_rank, MLA.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, weight).view(latent.shape[0], num_heads, MLA.qk_nope_head_dim + MLA.v_head_dim)
        k_nope, v = kv.split([MLA.qk_nope_head_dim, MLA.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, num_heads, -1)), dim=-1)
        out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, SCALE)
        start += qlen
    return out


# ----- one case -----


def scattered_tables(seqs: list[tuple[int, int]], gen: torch.Generator) -> tuple[list[list[int]], int]:
    needed = [-(-(start + qlen) // BLOCK_SIZE) for start, qlen in seqs]
    num_blocks = sum(needed) + 8
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    starts = [0, *torch.tensor(needed).cumsum(0).tolist()]
    return [pool[a:b] for a, b in zip(starts, starts[1:])], num_blocks


def case(shape: tuple[int, int, int] | None, seqs: list[tuple[int, int]], dtype: torch.dtype):
    """(old layer call, new layer call, old plan call, new plan call) on one random step."""
    gen = torch.Generator().manual_seed(1)
    tables, num_blocks = scattered_tables(seqs, gen)
    starts, qlens = [s for s, _ in seqs], [q for _, q in seqs]
    num_tokens = sum(qlens)

    def make_batch():
        return attention_batch(tables, starts, qlens, BLOCK_SIZE)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    old, new = old_plan(seqs, tables), torch_attention.torch_attention_plan(make_batch())
    if shape is None:
        heads = 4
        cache = randn(num_blocks, BLOCK_SIZE, MLA.kv_lora_rank + MLA.qk_rope_head_dim)
        weight = randn(heads * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank) / 4
        q_nope, q_rope = randn(num_tokens, heads, MLA.qk_nope_head_dim), randn(num_tokens, heads, MLA.qk_rope_head_dim)

        def run_old():
            return old_mla(q_nope, q_rope, cache, old, weight)

        def run_new(plan=new):
            return mla_attention(q_nope, q_rope, cache, plan, weight, MLA, SCALE)
    else:
        heads, kv_heads, dim = shape
        k_cache, v_cache = randn(num_blocks, BLOCK_SIZE, kv_heads, dim), randn(num_blocks, BLOCK_SIZE, kv_heads, dim)
        q = randn(num_tokens, heads, dim)

        def run_old():
            return old_paged(q, k_cache, v_cache, old)

        def run_new(plan=new):
            return paged_attention(q, k_cache, v_cache, plan, SCALE)

    torch.testing.assert_close(run_new().float(), run_old().float(), atol=2e-2, rtol=2e-2)
    return run_old, run_new, lambda: old_plan(seqs, tables), lambda: torch_attention.torch_attention_plan(make_batch())


def sdpa_bucket(q, k, v, bias, scale) -> torch.Tensor:
    """`bucket_attention`'s contract on torch's fused kernel."""
    n, lq, num_heads, _ = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=bias,
        scale=scale,
        enable_gqa=num_heads != k.shape[2],
    )
    return out.transpose(1, 2).reshape(n * lq, num_heads, v.shape[-1])


def with_sdpa(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        torch_attention.bucket_attention = sdpa_bucket
        try:
            return fn()
        finally:
            torch_attention.bucket_attention = BUCKET_ATTENTION

    return run


BUCKET_ATTENTION = torch_attention.bucket_attention


def interleaved(fns: list[Callable[[], object]], rounds: int, reps: int) -> list[float]:
    """Median over rounds of each function's mean call time (seconds); the functions take turns."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            t0 = time.process_time()
            for _ in range(reps):
                fn()
            out.append((time.process_time() - t0) / reps)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core machine)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2, help="layers per step, for the step ratio")
    parser.add_argument("--grids", type=int, nargs="*", default=[1, 4], help="other PADDED_CONTEXTS_PER_OCTAVE to time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    default_grid = torch_attention.PADDED_CONTEXTS_PER_OCTAVE
    rows = []
    print(
        f"{'shape':22} {'dtype':9} {'step':11} {'old us':>7} {'new us':>7} {'layer':>6} {'plan old/new':>13} "
        f"{'step':>6}  {'sdpa':>5}  grids (new-path time relative to the default grid)"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for shape_name, shape in SHAPES.items():
            for step_name, seqs in steps().items():
                run_old, run_new, plan_old, plan_new = case(shape, seqs, dtype)
                grid_fns = []
                for per_octave in args.grids:
                    torch_attention.PADDED_CONTEXTS_PER_OCTAVE = per_octave
                    grid_plan = plan_new()
                    torch_attention.PADDED_CONTEXTS_PER_OCTAVE = default_grid
                    grid_fns.append(functools.partial(run_new, grid_plan))
                t_old, t_new, t_plan_old, t_plan_new, t_sdpa, *t_grids = interleaved(
                    [run_old, run_new, plan_old, plan_new, with_sdpa(run_new), *grid_fns], args.rounds, args.reps
                )
                step_ratio = (t_plan_old + args.layers * t_old) / (t_plan_new + args.layers * t_new)
                row = dict(
                    shape=shape_name,
                    dtype=str(dtype).removeprefix("torch."),
                    step=step_name,
                    old_layer_us=t_old * 1e6,
                    new_layer_us=t_new * 1e6,
                    layer_ratio_old_over_new=t_old / t_new,
                    old_plan_us=t_plan_old * 1e6,
                    new_plan_us=t_plan_new * 1e6,
                    step_ratio_old_over_new=step_ratio,
                    sdpa_layer_us=t_sdpa * 1e6,
                    new_layer_us_by_grid={
                        str(default_grid): t_new * 1e6,
                        **{str(g): t * 1e6 for g, t in zip(args.grids, t_grids)},
                    },
                )
                rows.append(row)
                grids = " ".join(f"{g}:{t / t_new:.2f}" for g, t in zip(args.grids, t_grids))
                print(
                    f"{shape_name:22} {row['dtype']:9} {step_name:11} {t_old * 1e6:7.0f} {t_new * 1e6:7.0f} "
                    f"{t_old / t_new:6.2f} {t_plan_old * 1e6:6.0f}/{t_plan_new * 1e6:<6.0f} {step_ratio:6.2f}  "
                    f"{t_sdpa / t_new:5.2f}  {grids}"
                )
    result = dict(
        device=f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} torch thread(s), {torch.backends.cpu.get_cpu_capability()}",
        torch=torch.__version__,
        method=f"old and new interleaved in one process, CPU time; median over {args.rounds} rounds of the mean "
        f"of {args.reps} calls; step ratio for {args.layers} layers: (plan + layers x layer) old / new",
        default_grid=default_grid,
        layers=args.layers,
        rows=rows,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_attention.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'cpu_attention.json'}")


if __name__ == "__main__":
    main()
