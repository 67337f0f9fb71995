"""The MoE block: router -> dispatch -> experts -> combine, plus the optional shared expert.

Model code talks only to the `Dispatcher` interface, so EP backends slot in without changes here.
Nothing in the forward reads the device back: the load counters accumulate on the device and
are read once per report (`take_routed_tokens`).

`forward_steps` is the same block in steps (see `dispatch.base.Steps`), for two-batch overlap:
it yields wherever the dispatcher's dispatch or combine waits for peers, and at least once for
each of them, so the two micro-batches alternate at every dispatch and combine whatever the
backend (the `local` one never waits).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.dispatch import Dispatcher
from moeserve.dispatch.base import DispatchLayout, Steps, finish
from moeserve.dispatch.counts import count_per_expert
from moeserve.dispatch.replicas import ReplicaTable
from moeserve.dispatch.wire import rows_per_destination
from moeserve.models.layers.experts import Experts
from moeserve.models.layers.mlp import GatedMLP
from moeserve.models.layers.router import HashRouter, Router
from moeserve.ops import TORCH_OPS, LayerOps

T = TypeVar("T")


class MoEBlock(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dispatcher: Dispatcher,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
        hash_routed: bool = False,
    ) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        num_local = dispatcher.placement.num_local_experts
        self.router: Router | HashRouter = (
            HashRouter(cfg.router, cfg.hidden_size, cfg.num_experts, cfg.vocab_size, dtype, device)
            if hash_routed
            else Router(cfg.router, cfg.hidden_size, cfg.num_experts, dtype, device, ops)
        )
        self.experts = Experts(
            num_local,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype,
            device,
            ops,
            bias=cfg.expert_bias,
            activation=None if cfg.expert_activation.kind == "silu" else cfg.expert_activation,
        )
        routed = torch.zeros(num_local, dtype=torch.int64, device=device)
        self.register_buffer("routed_tokens", routed, persistent=False)
        """int64 `[E_local]`: rows each local expert received since the last read (the load /metrics
        reports); `MoECausalLM.take_routed_tokens` reads every layer's at once and resets them."""
        self.replicas: ReplicaTable | None = None
        """Logical -> physical slots of this layer; None: slot e holds expert e (no replicas)."""
        self.logical_load: torch.Tensor | None = None
        """int64 `[E]` or None: pairs this rank's tokens routed to each logical expert, summed
        since `track_logical_load` (never reset; the load window takes differences)."""
        placement = dispatcher.placement
        self.slot_owner = placement.owner.to(device) if placement.ep_size > 1 else None
        """int64 `[P]`: each physical slot's rank, for counting rows per destination (EP only)."""
        rows = torch.zeros(placement.ep_size, dtype=torch.int64, device=device)
        self.register_buffer("dispatch_rows", rows, persistent=False)
        """int64 `[ep]`: rows this rank dispatched to each rank since the last read (`dispatch.wire`)."""
        self.counted_rows: torch.Tensor | None = None
        """bool `[T]` or None: which of the step's rows the load counters count (None: all). Set
        only around a captured decode step (`MoECausalLM.counting_rows`), whose pad rows route
        like any other but are no load. At ep > 1 the receiver cannot tell peers' pad rows from
        real ones, so `routed_tokens` still counts those; the router-side counters do not."""
        self.shared = None
        self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            activation = cfg.expert_activation if cfg.shared_expert_activation else None
            self.shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device, ops, activation)
            if cfg.shared_expert_gated:
                self.shared_gate = nn.Parameter(
                    torch.empty(1, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
                )

    def rehome(self, dispatcher: Dispatcher, expert_params: dict[str, torch.Tensor]) -> None:
        """Serve the slots `dispatcher.placement` gives this rank after lost ranks, with
        `expert_params` (each tensor of `experts.named_parameters()` by its name, slot-major: a
        quantized one's storage and scales too) as their weights. The per-slot and
        per-destination counters restart at zero: the caller has read them under the old
        placement. The replica table is the model's to set (`MoECausalLM.rehome`)."""
        placement = dispatcher.placement
        for name, value in expert_params.items():
            if value.shape[0] != placement.num_local_experts:
                want = placement.num_local_experts
                raise ValueError(f"{name} has {value.shape[0]} slots; the placement gives {want}")
            # By the module that owns it: a quantized parameter's storage and scales are
            # replaced where they live, under its parametrization, not through its read name.
            owner, _, attr = name.rpartition(".")
            setattr(self.experts.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
        self.dispatcher = dispatcher
        device = self.routed_tokens.device
        self.routed_tokens = torch.zeros(placement.num_local_experts, dtype=torch.int64, device=device)
        self.dispatch_rows = torch.zeros(placement.ep_size, dtype=torch.int64, device=device)
        self.slot_owner = placement.owner.to(device) if placement.ep_size > 1 else None

    def track_logical_load(self) -> None:
        """Count each step's routing per logical expert from now on (one scatter-add per step)."""
        if self.logical_load is None:
            self.logical_load = torch.zeros(
                self.router.num_experts, dtype=torch.int64, device=self.routed_tokens.device
            )

    def forward(
        self, x: torch.Tensor, max_tokens_per_rank: int | None = None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`. max_tokens_per_rank: this step's bound on T over the EP group
        (see `Dispatcher.dispatch`); None where none is known. token_ids `[T]`: the tokens of
        x's rows, which a hash-routed block routes by (others ignore them)."""
        return finish(self.forward_steps(x, max_tokens_per_rank, token_ids))

    def forward_steps(
        self, x: torch.Tensor, max_tokens_per_rank: int | None = None, token_ids: torch.Tensor | None = None
    ) -> Steps[torch.Tensor]:
        """forward() in steps: yields while the dispatch or the combine waits for peers, and at
        least once after each. Every rank yields equally often for equal calls, provided the
        dispatcher's steps do (the `torch` backend's number depends only on the step's bound)."""
        if isinstance(self.router, HashRouter):
            if token_ids is None:
                raise ValueError("a hash-routed MoE block needs the token ids of its rows")
            topk_ids, topk_weights = self.router(x, token_ids)
        else:
            topk_ids, topk_weights = self.router(x)  # [T, K] logical ids, [T, K]
        weights = self._pair_weights(topk_ids)  # [T, K] int64 or None: what each pair counts
        if self.logical_load is not None:
            self.logical_load += count_per_expert(topk_ids, self.logical_load.shape[0], weights)
        slots = topk_ids if self.replicas is None else self.replicas.physical(topk_ids)  # [T, K] physical
        if self.slot_owner is not None:
            self.dispatch_rows += rows_per_destination(slots, self.slot_owner, self.dispatch_rows.shape[0], weights)
        dispatch = self.dispatcher.dispatch_steps(x, slots, topk_weights, max_tokens_per_rank)
        received = yield from _at_least_one_step(dispatch)
        self.routed_tokens += received.num_tokens_per_expert
        if weights is not None and received.layout is DispatchLayout.TOKEN_MAJOR:
            # Every received pair is one of this rank's own: take its pad rows' pairs back out.
            self.routed_tokens -= count_per_expert(slots, self.routed_tokens.shape[0], 1 - weights)
        handle = received.handle
        if self.replicas is not None:
            handle = dataclasses.replace(handle, sum_order=topk_ids)  # the sum in logical order
        out = yield from _at_least_one_step(self.dispatcher.combine_steps(self.experts(received), handle))
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def _pair_weights(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """int64 `[T, K]`: 1 for the pairs of counted rows, 0 for the others; None: all count."""
        rows = self.counted_rows
        if rows is None:
            return None
        if rows.shape[0] != topk_ids.shape[0]:
            raise ValueError(f"counted_rows has {rows.shape[0]} rows for a step of {topk_ids.shape[0]} tokens")
        return rows[:, None].expand_as(topk_ids).long()


def _at_least_one_step(steps: Steps[T]) -> Steps[T]:
    """`steps` as they are, plus one yield at the end if they never yielded."""
    yielded = False
    while True:
        try:
            next(steps)
        except StopIteration as done:
            if not yielded:
                yield
            return done.value
        yielded = True
        yield
