"""Dispatcher cases for `test_torch_dispatcher`: the data every rank builds, and the per-rank body.

Everything a case needs is derived from its seed, so each rank builds its own tokens and routing
(`rank_inputs`) and the parent rebuilds all ranks' inputs for the `local` reference without any
tensor crossing a process boundary on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from helpers.routing import routing

from moeserve.dispatch import (
    AllToAllDispatcher,
    Dispatcher,
    DispatchLayout,
    DispatchOutput,
    DispatchRows,
    ExpertPlacement,
    create_dispatcher,
)
from moeserve.dispatch.base import Steps, finish
from moeserve.models.layers.experts import Experts
from moeserve.ops.grouped_mlp import row_experts

H, I = 16, 24


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int
    top_k: int
    kind: str  # routing: "uniform", "skewed", "one_expert"
    placement: str  # "contiguous" or "round_robin" (expert e on rank e % ep)
    tokens_per_rank: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    hidden_size: int = H


def placement_for(case: Case, world_size: int, rank: int) -> ExpertPlacement:
    if case.placement == "contiguous":
        return ExpertPlacement.contiguous(case.num_experts, world_size, rank)
    return ExpertPlacement(tuple(e % world_size for e in range(case.num_experts)), world_size, rank)


def rank_inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's hidden `[T, H]`, topk_ids `[T, K]` and topk_weights `[T, K]`."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    num_tokens = case.tokens_per_rank[rank]
    hidden = torch.randn(num_tokens, case.hidden_size, generator=g).to(case.dtype)
    ids = routing(case.kind, num_tokens, case.num_experts, case.top_k, g)
    weights = torch.rand(num_tokens, case.top_k, generator=g)
    return hidden, ids, weights


def expert_weights(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every expert's w13 `[E, 2I, H]`, w2 `[E, H, I]`, and the toy experts' scale and shift `[E]`."""
    g = torch.Generator().manual_seed(case.seed)
    w13 = torch.randn(case.num_experts, 2 * I, case.hidden_size, generator=g) * 0.3
    w2 = torch.randn(case.num_experts, case.hidden_size, I, generator=g) * 0.3
    scale = torch.rand(case.num_experts, generator=g) + 0.5
    shift = torch.randn(case.num_experts, generator=g)
    return w13.to(case.dtype), w2.to(case.dtype), scale.to(case.dtype), shift.to(case.dtype)


def make_experts(case: Case, experts: tuple[int, ...]) -> Experts:
    """The gated-MLP experts with the given global ids, in that order."""
    w13, w2, _, _ = expert_weights(case)
    module = Experts(len(experts), case.hidden_size, I, case.dtype)
    index = torch.tensor(experts, dtype=torch.int64)
    module.w13.copy_(w13[index])
    module.w2.copy_(w2[index])
    return module


def toy_experts(case: Case, received: DispatchOutput, experts: tuple[int, ...]) -> torch.Tensor:
    """Row-wise experts built from correctly rounded elementwise ops only: a row's output does not
    depend on which other rows share its batch, so `torch` and `local` must agree bit for bit.
    Returns what `LayerOps.experts` would for the DispatchOutput's layout (padding rows as zeros)."""
    _, _, scale, shift = expert_weights(case)
    index = torch.tensor(experts, dtype=torch.int64)
    scale, shift = torch.cat([scale[index], scale.new_zeros(1)]), torch.cat([shift[index], shift.new_zeros(1)])
    if received.layout is DispatchLayout.TOKEN_MAJOR:
        rows = received.hidden.repeat_interleave(received.topk_ids.shape[1], dim=0)
        row_expert = received.topk_ids.reshape(-1)
    else:
        rows = received.hidden
        row_expert = row_experts(received.num_tokens_per_expert, rows.shape[0])  # padding: the zero expert
    return rows * rows * scale[row_expert, None] + shift[row_expert, None]


def expert_major(received: DispatchOutput) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rows each local expert receives, expert after expert without padding, and the counts."""
    counts = tuple(received.num_tokens_per_expert.tolist())
    if received.layout is DispatchLayout.EXPERT_MAJOR:
        return received.hidden[: sum(counts)], counts
    top_k = received.topk_ids.shape[1]
    order = torch.argsort(received.topk_ids.reshape(-1), stable=True)
    return received.hidden.index_select(0, order // top_k), counts


def case_steps(dispatcher: Dispatcher, case: Case, rank: int, world_size: int) -> Steps[dict]:
    """One rank's run of a case in every mode, as steps (so emulated PEs can run it in lockstep):
    per mode, the rows each local expert received, the counts, and combine() of the real and of
    the toy experts."""
    placement = placement_for(case, world_size, rank)
    hidden, ids, weights = rank_inputs(case, rank)
    per_mode = {}
    for mode, bound in modes(case):
        received = yield from dispatcher.dispatch_steps(hidden, ids, weights, bound)
        rows, counts = expert_major(received)
        expert_rows = make_experts(case, placement.local_experts)(received)
        out = yield from dispatcher.combine_steps(expert_rows, received.handle)
        toy_rows = toy_experts(case, received, placement.local_experts)
        toy_out = yield from dispatcher.combine_steps(toy_rows, received.handle)
        per_mode[mode] = {
            "received": rows,
            "counts": counts,
            "host_counts": received.num_tokens_per_expert_host,
            "syncs_host": dispatcher.syncs_host(bound),
            "num_rows": received.hidden.shape[0],
            "out": out,
            "toy_out": toy_out,
        }
    return per_mode


def run_cases(
    rank: int, world_size: int, cases: list[Case], backend: str = "torch", options: dict | None = None
) -> dict:
    """Per-rank body: every case through `backend` (built with `options`) in every mode, plus the
    refused-group checks of the `torch` backend.

    One intra-op thread, like the parent's reference: CPU GEMMs round differently with another
    thread count, and the rows each expert sees are the same, so the outputs can match exactly.
    """
    torch.set_num_threads(1)
    results = []
    for case in cases:
        rows = DispatchRows(case.hidden_size, case.top_k, case.dtype)
        dispatcher = create_dispatcher(backend, placement_for(case, world_size, rank), rows=rows, **(options or {}))
        results.append(finish(case_steps(dispatcher, case, rank, world_size)))
    return {"cases": results, "refusals": refusals(rank, world_size) if backend == "torch" else []}


def reference(case: Case, world_size: int, dispatch_fp8: bool = False):
    """`local` on all ranks' tokens: its rows per expert and counts, combine() of the real and of the toy experts."""
    inputs = [rank_inputs(case, r) for r in range(world_size)]
    hidden, ids, weights = (torch.cat(parts) for parts in zip(*inputs))
    local = create_dispatcher("local", ExpertPlacement.contiguous(case.num_experts), dispatch_fp8=dispatch_fp8)
    received = local.dispatch(hidden, ids, weights)
    all_experts = tuple(range(case.num_experts))
    out = local.combine(make_experts(case, all_experts)(received), received.handle)
    toy_out = local.combine(toy_experts(case, received, all_experts), received.handle)
    return *expert_major(received), out, toy_out


def assert_matches_local(
    world_size: int, cases: list[Case], results: list[dict], low_latency_max_tokens: int, dispatch_fp8: bool = False
) -> None:
    """Every rank's results (from `case_steps`) against `local` on all ranks' tokens: each expert
    gets exactly its rows in `local`'s order, the toy experts' combine is bit-equal, the real
    experts' equal within rounding; and the mode (host read or padded rows) follows the bound.
    dispatch_fp8: the results come from FP8 dispatch, so `local` quantises too."""
    for c, case in enumerate(cases):
        ref_hidden, ref_counts, ref_out, ref_toy = reference(case, world_size, dispatch_fp8)
        ref_rows = torch.split(ref_hidden, list(ref_counts))
        token_rows = torch.split(torch.arange(sum(case.tokens_per_rank)), list(case.tokens_per_rank))
        for rank in range(world_size):
            experts = placement_for(case, world_size, rank).local_experts
            for mode, bound in modes(case):
                got = results[rank]["cases"][c][mode]
                where = f"{case.name}, rank {rank}, {mode}"
                assert got["counts"] == tuple(ref_counts[e] for e in experts), where
                # the uneven mode hands on the counts it read; the low-latency one reads nothing
                uneven = bound is None or bound > low_latency_max_tokens
                assert got["syncs_host"] == uneven, where
                assert got["host_counts"] == (got["counts"] if uneven else None), where
                if not uneven:  # fixed-size regions: rows past the counts are padding
                    lmax = placement_for(case, world_size, 0).max_local_experts
                    assert got["num_rows"] == world_size * bound * min(case.top_k, lmax), where
                else:
                    assert got["num_rows"] == sum(got["counts"]), where
                # each local expert receives exactly the rows `local` hands it, in the same order
                for e, rows in zip(experts, torch.split(got["received"], list(got["counts"]))):
                    assert torch.equal(rows, ref_rows[e]), f"{where}: rows of expert {e}"
                mine = token_rows[rank]
                assert torch.equal(got["toy_out"], ref_toy[mine]), f"{where}: combine order differs from local's"
                tol = 1e-6 if case.dtype == torch.float32 else 1e-2
                # real GEMMs: bit-equal too on this CPU at equal thread counts, but BLAS does not promise it
                torch.testing.assert_close(
                    got["out"], ref_out[mine], rtol=tol, atol=tol, msg=lambda m, where=where: f"{where}: {m}"
                )


def modes(case: Case) -> tuple[tuple[str, int | None], ...]:
    """(name, max_tokens_per_rank) of each mode a case runs in: no bound (uneven splits, one host
    read), the tightest bound and a looser one (equal splits, padding, no host read)."""
    tightest = max(case.tokens_per_rank)
    return (("uneven", None), ("low_latency", tightest), ("low_latency_loose", tightest + 3))


def refusals(rank: int, world_size: int) -> list[str]:
    """The ValueError messages of dispatchers built for a group of the wrong size, for the wrong
    rank, and (through the registry) for a one-rank subgroup that the placement does not fit."""
    own_group, _ = dist.new_subgroups(group_size=1)  # collective: every rank makes its own
    create_dispatcher("torch", ExpertPlacement.contiguous(8), group=own_group)  # fits: accepted
    messages = []
    for build in (
        lambda: AllToAllDispatcher(ExpertPlacement.contiguous(2 * world_size + 2, world_size + 1, rank)),
        lambda: AllToAllDispatcher(ExpertPlacement.contiguous(2 * world_size, world_size, (rank + 1) % world_size)),
        lambda: create_dispatcher(
            "torch", ExpertPlacement.contiguous(2 * world_size, world_size, rank), group=own_group
        ),
    ):
        try:
            build()
        except ValueError as e:
            messages.append(str(e))
    return messages


def run_backends(rank: int, world_size: int, cases: list[Case], backends: list[tuple[str, dict]]) -> list[dict]:
    """`run_cases` for each (backend, options) in turn, in the same rank processes: one spawn
    serves several backends."""
    return [run_cases(rank, world_size, cases, name, options) for name, options in backends]
