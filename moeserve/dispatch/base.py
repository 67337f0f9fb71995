"""The Dispatcher interface: how an MoE layer moves tokens to their experts and back.

Pipeline of one MoE layer (every backend, every device):

    router -> topk_ids [T, K], topk_weights [T, K]
           -> dispatch(): the rows this rank's experts must process    -> DispatchOutput
           -> experts (grouped GEMM over those rows; `LayerOps.experts`)
           -> combine(): expert outputs sent back to their source rank and
              reduced over k with the top-k weights (`combine.weighted_sum`) -> [T, H]

Contract every backend agrees on, bit for bit: for the same inputs `local`, `torch` and
`nvshmem` return the same combine() result; they all reduce with the one `weighted_sum`, so this
holds by construction once the experts' rows agree. Nothing of a step is kept on the dispatcher:
the handle returned by dispatch() carries everything combine() needs.

FP8 rows (`dispatch_fp8`, every backend): dispatch sends each token as e4m3 bytes plus a scale
per 128 channels (`dispatch.fp8`) and the receiver dequantises them to the activation dtype
before the experts; combine moves the outputs in the activation dtype. `local` applies the same
quantise -> dequantise, so the contract above holds with FP8 on as well.

No host round trip: a DispatchOutput's counts are a device tensor. A backend that must read
the device (the `torch` backend's uneven all-to-all needs Python split sizes) says so through
`syncs_host()` and hands what it read over as `num_tokens_per_expert_host`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from moeserve.dispatch.fp8 import FP8Rows
from moeserve.dispatch.placement import ExpertPlacement

T = TypeVar("T")
Steps = Generator[None, None, T]
"""A dispatch or combine in steps: the generator yields where it has sent and now waits for
peers, and returns the result. Whoever drives it may run other work at each yield (the other
micro-batch's compute in two-batch overlap, or the other PEs of an emulated group)."""


def finish(steps: Steps[T]) -> T:
    """Run steps to the end, with nothing in between, and return their result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class DispatchLayout(enum.Enum):
    """How the rows of `DispatchOutput.hidden` are arranged.

    TOKEN_MAJOR:   hidden is the source tokens `[T, H]` as they came, unpermuted; `topk_ids`
                   (local expert ids) `[T, K]` says which experts each row goes to. The experts
                   return one row per (token, k) pair, `[T * K, H]`, row `t * K + k`. EP = 1:
                   nothing moved, so a grouped GEMM can gather rows from the ids itself.
    EXPERT_MAJOR:  rows grouped by local expert, expert 0's first, `counts[e]` rows each,
                   possibly followed by padding rows past `sum(counts)` (content unspecified);
                   the experts return one row per row of hidden (padding rows unspecified).
    """

    TOKEN_MAJOR = "token_major"
    EXPERT_MAJOR = "expert_major"


@dataclass(frozen=True)
class DispatchHandle:
    """Backend-specific routing state from dispatch() to combine(). Subclassed per backend.

    The handle may reference dispatch()'s inputs (`topk_ids`, `topk_weights`): they must not be
    modified in place before combine() returns.
    """

    num_tokens: int  # T on the source rank; combine() returns [T, H]
    sum_order: torch.Tensor | None = field(default=None, kw_only=True)
    """int64 `[T, K]` or None: ids whose ascending order is the order of combine's sum over k
    (None: dispatch()'s `topk_ids`). An MoE layer that dispatched to physical replicas sets it to
    the router's logical ids (`dataclasses.replace`), so a token's sum runs in the same order
    whichever replicas served it, and its result equals the single process's bit for bit."""


@dataclass(frozen=True)
class DispatchOutput:
    """Tokens this rank's experts must process.

    hidden:                      `[N, H]` in the input's dtype, on its device, arranged as `layout` says.
                                 With `dispatch_fp8`, the dequantised FP8 rows (`fp8.round_trip`
                                 of the sent rows), what the torch expert path takes.
    num_tokens_per_expert:       int64 `[E_local]` on hidden's device: rows (pairs) per local expert.
    num_tokens_per_expert_host:  the same counts as a tuple, only from a backend that already read
                                 them back (None otherwise); never worth a sync of its own.
    layout:                      see `DispatchLayout`.
    topk_ids:                    TOKEN_MAJOR: int64 `[T, K]` local expert ids of each row; else None.
    handle:                      pass unchanged to combine().
    fp8_rows:                    with `dispatch_fp8`, the same rows as received, FP8 bytes and
                                 scales (`fp8.FP8Rows`): FP8 experts whose GEMMs quantize their
                                 input alike (w8a8, 128-channel groups) take them as they are.
    """

    hidden: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    layout: DispatchLayout
    handle: DispatchHandle
    num_tokens_per_expert_host: tuple[int, ...] | None = None
    topk_ids: torch.Tensor | None = None
    fp8_rows: FP8Rows | None = None


class Dispatcher(ABC):
    """One all-to-all backend. Stateless between steps; safe to share across layers.

    Every rank of the EP group must call dispatch() and combine() the same number of times, in
    the same order and with the same `max_tokens_per_rank` (a rank with no tokens still calls,
    with `T = 0`): a backend that communicates joins collectives in both.
    """

    name: ClassVar[str]

    def __init__(self, placement: ExpertPlacement, dispatch_fp8: bool = False) -> None:
        """dispatch_fp8: send tokens as FP8 rows with per-128-channel scales (module docstring)."""
        self.placement = placement
        self.dispatch_fp8 = dispatch_fp8

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        """None if this backend can run the layout, else the reason it cannot."""
        return None

    def syncs_host(self, max_tokens_per_rank: int | None) -> bool:
        """Whether dispatch() with this bound reads device data back to the host."""
        return False

    def check_step(self) -> None:
        """Raise if this step's exchange failed (a peer dead or stalled). The model runner calls
        it once a step's tokens are sampled and before any leaves the device, so the step never
        produces tokens computed without some experts' rows. A backend that raises inside
        dispatch()/combine() (it waits on the host) has nothing to add."""
        return None  # noqa: B027 - a hook: only a backend that waits on the device overrides it

    def graph_capture_refusal(self, max_tokens_per_rank: int) -> str | None:
        """None if a decode step with this bound can be captured in a CUDA graph and replayed,
        else why not. A replay reruns the captured kernels with the arguments they had, so a
        backend that reads the device back or keeps per-call state on the host cannot be."""
        if self.syncs_host(max_tokens_per_rank):
            return f"the {self.name} backend reads counts back to the host at a bound of {max_tokens_per_rank}"
        return None

    @abstractmethod
    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> DispatchOutput:
        """Send each token's row to the ranks holding its top-k experts.

        hidden:              `[T, H]` float32/float16/bfloat16, this rank's tokens.
        topk_ids:            int64 `[T, K]` global expert ids, on hidden's device, distinct per token.
        topk_weights:        float32 `[T, K]`, on hidden's device; applied by combine(), not here.
        max_tokens_per_rank: a bound on T over every rank of the EP group this step, the same on
                             every rank and known without communication (None: no bound known).
                             A backend may use it to pick a fixed-size, sync-free wire format;
                             T above it raises ValueError.
        Hazards: topk_ids and topk_weights are referenced by the handle (see DispatchHandle).
        """

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """The experts' rows home again, reduced over k: `[T, H]` in expert_output's dtype.

        expert_output: what `LayerOps.experts` returned for this dispatch (`[T * K, H]` pair rows
                       for TOKEN_MAJOR, `[N, H]` for EXPERT_MAJOR), same dtype and device as hidden.
        handle:        the DispatchOutput's, used once.
        """

    def dispatch_steps(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> Steps[DispatchOutput]:
        """dispatch() in steps (see `Steps`). A backend that can send without waiting derives from
        `SteppedDispatcher` instead; the default is one step."""
        return self.dispatch(hidden, topk_ids, topk_weights, max_tokens_per_rank)
        yield  # a generator with no yield: one step

    def combine_steps(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Steps[torch.Tensor]:
        """combine() in steps (see `dispatch_steps`)."""
        return self.combine(expert_output, handle)
        yield  # a generator with no yield: one step


class SteppedDispatcher(Dispatcher):
    """A backend whose dispatch and combine are written in steps (it sends, yields while peers
    answer, then receives): dispatch() and combine() are those steps run to the end."""

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> DispatchOutput:
        return finish(self.dispatch_steps(hidden, topk_ids, topk_weights, max_tokens_per_rank))

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return finish(self.combine_steps(expert_output, handle))

    @abstractmethod
    def dispatch_steps(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> Steps[DispatchOutput]: ...

    @abstractmethod
    def combine_steps(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Steps[torch.Tensor]: ...
