"""FP8 dispatch rows on every backend: `torch` (gloo ranks) and `nvshmem` (emulated PEs, and
shared-memory rank processes) equal `local` with the same quantisation, bit for bit, in every
mode: the experts' rows, the toy experts' combine, and (within BLAS rounding) the real experts'.

A few cases in the dispatcher tests' style (the suite's time is short), one of them bf16 rows of
H = 200, two groups of which the second is partial, so several scales and a padded row travel.
"""

from __future__ import annotations

import torch
from dispatch_cases import Case, H, assert_matches_local, run_backends
from ranks import run_ranks
from test_nvshmem_dispatcher import CHUNKS, emulated_results
from test_torch_dispatcher import TOKENS

from moeserve.dispatch.all_to_all import LOW_LATENCY_MAX_TOKENS


def fp8_cases(world_size: int) -> list[Case]:
    """Uniform, skewed and one-expert routing, both placements (7 experts: uneven over the
    ranks), float32 and bfloat16, some rank without tokens in each; and rows of 200 channels."""
    shapes = [
        (8, 2, "uniform", "contiguous", torch.float32, H),
        (16, 8, "skewed", "round_robin", torch.bfloat16, H),
        (7, 3, "one_expert", "round_robin", torch.float32, H),
        (8, 2, "skewed", "round_robin", torch.bfloat16, 200),
    ]
    cases = []
    for i, (num_experts, top_k, kind, placement, dtype, hidden_size) in enumerate(shapes):
        tokens = tuple(TOKENS[(r + 2 * i) % len(TOKENS)] for r in range(world_size))
        name = f"H{hidden_size}-E{num_experts}-k{top_k}-{kind}-{placement}-{str(dtype)[6:]}-tokens{list(tokens)}"
        cases.append(
            Case(name, num_experts, top_k, kind, placement, tokens, dtype, seed=50 + i, hidden_size=hidden_size)
        )
    return cases


def test_emulated_pes_equal_local(one_thread: None) -> None:
    """Two PEs in one process, chunks of 16 tokens: every mode streams through the ring slots
    (the low-latency mode runs across rank processes below)."""
    cases = fp8_cases(2)[1::2]  # the k=8 bf16 case and the 200-channel one
    results = emulated_results(2, cases, CHUNKS["chunked"], dispatch_fp8=True)
    assert_matches_local(2, cases, results, CHUNKS["chunked"], dispatch_fp8=True)


def test_torch_and_shared_memory_ranks_equal_local(one_thread: None) -> None:
    """Two rank processes run both backends with FP8 rows: each equals `local`, and they equal each other."""
    cases = fp8_cases(2)
    backends = [
        ("torch", {"dispatch_fp8": True}),
        ("nvshmem", {"chunk_tokens": CHUNKS["low_latency"], "dispatch_fp8": True}),
    ]
    per_rank = run_ranks(2, run_backends, cases, backends, timeout=300)
    torch_results, nvshmem_results = ([per_rank[r][b] for r in range(2)] for b in range(2))
    assert_matches_local(2, cases, torch_results, LOW_LATENCY_MAX_TOKENS, dispatch_fp8=True)
    assert_matches_local(2, cases, nvshmem_results, CHUNKS["low_latency"], dispatch_fp8=True)
    for rank in range(2):
        for c, case in enumerate(cases):
            for mode, got in nvshmem_results[rank]["cases"][c].items():
                want = torch_results[rank]["cases"][c][mode]
                for key in ("received", "out", "toy_out"):
                    assert torch.equal(got[key], want[key]), f"{case.name}, rank {rank}, {mode}: {key}"
