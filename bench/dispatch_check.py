"""Correctness half of `bench/dispatch.py`: the `nvshmem` backend against `local`, bit for bit.

Each case gives every PE its own tokens and routing (derived from a seed, so the reference can
rebuild them all), runs dispatch, row-wise "toy" experts and combine through the `nvshmem`
backend on every PE in lockstep, and compares each PE's results with the `local` dispatcher run
on all PEs' tokens at once, the reference the `torch` backend is itself tested against:

* the rows each local expert receives, and their order, equal `local`'s rows of that expert;
* the counts per expert, and the mode's contract (padded rows and no host read in the
  low-latency mode, the counts read to the host in the high-throughput one);
* combine's output equals `local`'s for this PE's tokens.

How the PEs' steps are driven is the caller's: `run_lockstep` on one host thread (the PEs' comm
streams see their kernels in the order of the rounds), or `run_concurrently` on CUDA, each PE on
a host thread and a stream of its own with nothing ordering them but the kernels' own signals
and credits, over several rounds on the same dispatchers so the ring slots are reused.

The toy experts (`rows * rows * scale[e] + shift[e]`) are elementwise, so a row's output does not
depend on which rows share its batch and `torch.equal` is the right test on every device and
dtype; both sides then reduce with the one `weighted_sum`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.dispatch import DispatchOutput, DispatchRows, ExpertPlacement, LocalDispatcher, NvshmemDispatcher
from moeserve.dispatch.base import Steps, finish
from moeserve.dispatch.nvshmem_layout import SymmetricLayout
from moeserve.dispatch.symmetric import SymmetricHeap, run_lockstep
from moeserve.ops.grouped_mlp import row_experts

LOW_LATENCY, HIGH_THROUGHPUT = "low_latency", "high_throughput"
SMALL = (128, 0, 77, 128, 5, 128, 31, 100)  # tokens per PE within the 128-token low-latency bound
LARGE = (300, 0, 129, 257, 64, 300, 1, 200)  # up to 3 chunks of 128: high-throughput only
SMOKE_SMALL, SMOKE_LARGE = (6, 0), (11, 17)  # the same roles at the smoke run's 8-token chunks


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    kind: str  # routing: "uniform", "skewed" (experts 0 and 1 hot) or "one_expert" (all pick the last)
    placement: str  # "contiguous", or "round_robin" (expert e on PE e % world)
    pattern: tuple[int, ...]  # PE r gets pattern[r % len(pattern)] tokens
    dtype: torch.dtype
    seed: int
    fp8: bool = False  # dispatch FP8 rows (per-128 e4m3 with scales); `local` applies the same round trip

    def tokens(self, world: int) -> tuple[int, ...]:
        return tuple(self.pattern[r % len(self.pattern)] for r in range(world))

    def modes(self, world: int, chunk_tokens: int) -> tuple[tuple[str, int | None], ...]:
        """(mode, max_tokens_per_rank): the tightest bound where it is low-latency, and no bound."""
        tightest = max(self.tokens(world))
        low = ((LOW_LATENCY, tightest),) if tightest <= chunk_tokens else ()
        return (*low, (HIGH_THROUGHPUT, None))


def cases_for(world: int, smoke: bool) -> list[Case]:
    """DeepSeek-V3's shape in bf16 and fp32, odd row sizes, experts that do not split evenly, a
    hot expert, one expert taking every first pick, PEs without tokens, FP8 rows (a partial last
    scale group too), and (at 8 PEs) a PE without experts. Smoke: two tiny cases the interpreter
    runs in seconds."""
    bf16, fp32 = torch.bfloat16, torch.float32
    if smoke:
        return [
            Case("E8-k2-uniform-contiguous-bf16-fp8", 8, 2, 16, "uniform", "contiguous", SMOKE_SMALL, bf16, 1, True),
            Case("E5-k3-skewed-round_robin-fp32-3chunks", 5, 3, 12, "skewed", "round_robin", SMOKE_LARGE, fp32, 2),
        ]
    odd = 2 * world + 1
    cases = [
        Case("dsv3-E256-k8-uniform-contiguous-bf16", 256, 8, 7168, "uniform", "contiguous", SMALL, bf16, 1),
        Case("dsv3-E256-k8-skewed-round_robin-fp32", 256, 8, 7168, "skewed", "round_robin", SMALL, fp32, 2),
        Case(f"E{odd}-k3-one_expert-round_robin-bf16-H2050", odd, 3, 2050, "one_expert", "round_robin", LARGE, bf16, 3),
        Case("E16-k4-uniform-contiguous-fp32-H1000", 16, 4, 1000, "uniform", "contiguous", LARGE, fp32, 4),
        Case("no-tokens-anywhere", 8, 2, 256, "uniform", "contiguous", (0,), fp32, 5),
        Case("dsv3-E256-k8-skewed-contiguous-bf16-fp8", 256, 8, 7168, "skewed", "contiguous", SMALL, bf16, 7, True),
        Case("E16-k4-uniform-round_robin-fp32-H1000-fp8", 16, 4, 1000, "uniform", "round_robin", LARGE, fp32, 8, True),
    ]
    if world == 8:  # 7 experts dealt over 8 PEs: PE 7 holds none
        cases.append(Case("rank-without-experts-E7", 7, 2, 512, "skewed", "round_robin", SMALL, bf16, 6))
    return cases


def symmetric_memory_cases() -> list[Case]:
    """World 1 over PyTorch symmetric memory: small buffers, so NVSHMEM's default heap holds them."""
    return [
        Case("E64-k8-uniform-bf16-H2048", 64, 8, 2048, "uniform", "contiguous", (128,), torch.bfloat16, 7),
        Case("E16-k4-skewed-fp32-H1000-3chunks", 16, 4, 1000, "skewed", "contiguous", (300,), torch.float32, 8),
    ]


def case_layout(case: Case, world: int, chunk_tokens: int, staged: bool = False) -> SymmetricLayout:
    """The symmetric buffer each PE's dispatcher allocates for `case`: what a heap is sized for.
    staged: with the put path's staging regions (some peer is reached by puts)."""
    rows = DispatchRows(case.hidden, case.top_k, case.dtype)
    return SymmetricLayout.for_rows(placement_for(case, world, 0), rows, chunk_tokens, case.fp8, staged)


def placement_for(case: Case, world: int, rank: int) -> ExpertPlacement:
    if case.placement == "contiguous":
        return ExpertPlacement.contiguous(case.num_experts, world, rank)
    return ExpertPlacement(tuple(e % world for e in range(case.num_experts)), world, rank)


def routing(kind: str, num_tokens: int, num_experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """int64 `[T, K]`, distinct experts per token, drawn on g's device."""
    scores = torch.rand(num_tokens, num_experts, generator=g, device=g.device)
    if kind == "skewed":
        scores[:, :2] += torch.tensor([3.0, 2.0], device=g.device)
    elif kind == "one_expert":
        scores[:, -1] = 2.0
    elif kind != "uniform":
        raise ValueError(f"unknown routing kind {kind!r}")
    return scores.topk(top_k, dim=-1).indices


def rank_inputs(case: Case, world: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """PE rank's hidden `[T, H]`, topk_ids `[T, K]` and topk_weights `[T, K]` (drawn on CPU, then moved)."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    num_tokens = case.tokens(world)[rank]
    hidden = torch.randn(num_tokens, case.hidden, generator=g).to(case.dtype)
    ids = routing(case.kind, num_tokens, case.num_experts, case.top_k, g)
    weights = torch.rand(num_tokens, case.top_k, generator=g)
    return hidden.to(device), ids.to(device), weights.to(device)


def toy_weights(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per global expert scale and shift `[E + 1]`; entry E (padding rows) is zero."""
    g = torch.Generator().manual_seed(case.seed)
    scale = torch.cat([torch.rand(case.num_experts, generator=g) + 0.5, torch.zeros(1)])
    shift = torch.cat([torch.randn(case.num_experts, generator=g), torch.zeros(1)])
    return scale.to(case.dtype).to(device), shift.to(case.dtype).to(device)


def toy(rows: torch.Tensor, expert: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return rows * rows * scale[expert, None] + shift[expert, None]


def toy_experts(
    case: Case, placement: ExpertPlacement, scale: torch.Tensor, shift: torch.Tensor, device: torch.device
) -> Callable[[DispatchOutput], torch.Tensor]:
    """A PE's toy experts: each received row through its local expert's `toy` (padding rows: the zero expert)."""
    ids = torch.tensor((*placement.local_experts, case.num_experts), device=device)

    def run(received: DispatchOutput) -> torch.Tensor:
        expert = ids[row_experts(received.num_tokens_per_expert, received.hidden.shape[0])]
        return toy(received.hidden, expert, scale, shift)

    return run


def pe_steps(
    dispatcher: NvshmemDispatcher,
    inputs: Sequence[torch.Tensor],
    bound: int | None,
    experts: Callable[[DispatchOutput], torch.Tensor],
) -> Steps[tuple[DispatchOutput, torch.Tensor]]:
    """One PE's dispatch, experts and combine, as steps for `run_lockstep`."""
    received = yield from dispatcher.dispatch_steps(*inputs, bound)
    out = yield from dispatcher.combine_steps(experts(received), received.handle)
    return received, out


@dataclass(frozen=True)
class Reference:
    rows: list[torch.Tensor]  # per global expert: the rows `local` hands it, in order
    counts: list[int]  # per global expert
    out: torch.Tensor  # `[sum T, H]`: combine of the toy experts, every PE's tokens in PE order


def reference(case: Case, inputs: list[tuple[torch.Tensor, ...]], scale, shift) -> Reference:
    hidden, ids, weights = (torch.cat(parts) for parts in zip(*inputs))
    local = LocalDispatcher(ExpertPlacement.contiguous(case.num_experts), dispatch_fp8=case.fp8)
    received = local.dispatch(hidden, ids, weights)
    hidden = received.hidden  # the tokens as the experts see them (FP8: quantised and back)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = received.num_tokens_per_expert.tolist()
    rows = list(torch.split(hidden.index_select(0, order // case.top_k), counts))
    out = local.combine(toy(hidden.repeat_interleave(case.top_k, 0), flat, scale, shift), received.handle)
    return Reference(rows, counts, out)


def compare_pe(
    received: DispatchOutput,
    out: torch.Tensor,
    ref: Reference,
    placement: ExpertPlacement,
    first_token: int,
    bound: int | None,
    top_k: int,
) -> list[str]:
    """What differs between one PE's results and the reference (empty: bit-equal)."""
    problems = []
    experts = placement.local_experts
    counts = tuple(received.num_tokens_per_expert.tolist())
    want_counts = tuple(ref.counts[e] for e in experts)
    if counts != want_counts:
        problems.append(f"counts {counts} != {want_counts}")
    else:
        got = received.hidden[: sum(counts)]
        want = torch.cat([ref.rows[e] for e in experts]) if experts else got[:0]
        if not torch.equal(got, want):
            bad = (got != want).any(1).nonzero().flatten()
            problems.append(f"received rows differ at {bad.numel()} rows, first {bad[:4].tolist()}")
    if bound is None:
        if received.num_tokens_per_expert_host != counts:
            problems.append(f"host counts {received.num_tokens_per_expert_host} != {counts}")
    else:
        padded = placement.ep_size * bound * min(top_k, placement.max_local_experts)
        if received.hidden.shape[0] != padded or received.num_tokens_per_expert_host is not None:
            problems.append(f"low-latency output of {received.hidden.shape[0]} rows (want {padded}) or a host read")
    want_out = ref.out[first_token : first_token + out.shape[0]]
    if out.shape != want_out.shape or not torch.equal(out, want_out):
        problems.append("combine output differs from local's")
    return problems


def run_concurrently(steps: Sequence[Steps[Any]], device: torch.device) -> list[Any]:
    """Each PE's steps run to the end on a host thread and a CUDA stream of its own (its
    dispatcher's comm streams beside it), all at once: no PE waits for another on the host, so
    every wait, credit and slot reuse is the kernels' own, as on PEs that are separate GPUs."""

    def one(pe_steps: Steps[Any]) -> Any:
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            result = finish(pe_steps)
        stream.synchronize()
        return result

    with ThreadPoolExecutor(max_workers=len(steps)) as pool:
        return list(pool.map(one, steps))


def check_case(
    case: Case,
    world: int,
    mode: str,
    bound: int | None,
    heaps: Callable[[], list[SymmetricHeap]],
    device: torch.device,
    chunk_tokens: int,
    drive: Callable[[Sequence[Steps[Any]]], list[Any]] = run_lockstep,
    rounds: int = 1,
) -> dict:
    """One case in one mode on `world` PEs of the heaps `heaps()` returns; a record for the JSON.
    drive: runs the PEs' steps (see the module docstring); rounds: times the case is run on the
    same dispatchers, each checked."""
    dtype = str(case.dtype).removeprefix("torch.")
    record = {"world": world, "case": case.name, "mode": mode, "dtype": dtype, "fp8": case.fp8}
    inputs = [rank_inputs(case, world, r, device) for r in range(world)]
    placements = [placement_for(case, world, r) for r in range(world)]
    scale, shift = toy_weights(case, device)
    rows = DispatchRows(case.hidden, case.top_k, case.dtype)
    dispatchers = [
        NvshmemDispatcher(p, rows, device=device, heap=h, chunk_tokens=chunk_tokens, dispatch_fp8=case.fp8)
        for p, h in zip(placements, heaps())
    ]

    ref = reference(case, inputs, scale, shift)
    starts = [sum(case.tokens(world)[:r]) for r in range(world)]
    experts = [toy_experts(case, p, scale, shift, device) for p in placements]
    problems = []
    for repeat in range(rounds):
        results = drive([pe_steps(d, i, bound, e) for d, i, e in zip(dispatchers, inputs, experts)])
        problems += [
            f"round {repeat} PE {r}: {problem}" if rounds > 1 else f"PE {r}: {problem}"
            for r, ((received, out), placement) in enumerate(zip(results, placements))
            for problem in compare_pe(received, out, ref, placement, starts[r], bound, case.top_k)
        ]
    return dict(record, rounds=rounds, passed=not problems, problems=problems)


def check_pe(
    case: Case,
    world: int,
    rank: int,
    mode: str,
    bound: int | None,
    heap: SymmetricHeap,
    device: torch.device,
    chunk_tokens: int,
    nvlink_domain_size: int | None = None,
) -> dict:
    """PE `rank` of `world`, the only one in this process (each peer runs the same call in its own,
    over a heap they share): its results against the reference, a record for the JSON.
    nvlink_domain_size: the dispatcher's (0: every peer, this PE too, by puts)."""
    dtype = str(case.dtype).removeprefix("torch.")
    record = {"world": world, "rank": rank, "case": case.name, "mode": mode, "dtype": dtype, "fp8": case.fp8}
    inputs = [rank_inputs(case, world, r, device) for r in range(world)]
    placement = placement_for(case, world, rank)
    scale, shift = toy_weights(case, device)
    dispatcher = NvshmemDispatcher(
        placement,
        DispatchRows(case.hidden, case.top_k, case.dtype),
        device=device,
        heap=heap,
        chunk_tokens=chunk_tokens,
        dispatch_fp8=case.fp8,
        nvlink_domain_size=nvlink_domain_size,
    )
    experts = toy_experts(case, placement, scale, shift, device)
    received, out = finish(pe_steps(dispatcher, inputs[rank], bound, experts))
    ref = reference(case, inputs, scale, shift)
    first_token = sum(case.tokens(world)[:rank])
    problems = compare_pe(received, out, ref, placement, first_token, bound, case.top_k)
    return dict(record, passed=not problems, problems=problems)
