"""`torch` backend: expert parallelism over `torch.distributed.all_to_all_single` (gloo or NCCL).

Wire format. dispatch() makes two collectives over the EP group:

1. counts: an int64 tensor `[ep, L]` per rank (L = `placement.max_local_experts`), row `r`
   holding how many of this rank's (token, k) pairs go to each local expert of rank `r`.
   One equal-split all_to_all_single turns it into the counts this rank receives from every
   source rank, per local expert: the receiver learns which expert each row belongs to without
   any expert ids travelling with the rows.
2. payload: the hidden rows themselves, in their own dtype, one row per (token, k) pair, each
   source's rows for one destination sorted by the destination's local expert, in one of two
   modes:

   * high-throughput (uneven): splits of exactly the rows sent. An uneven all-to-all needs the
     split sizes as Python ints on both sides, so the counts are read back once per dispatch:
     the one host sync of this backend, which it hands on as `num_tokens_per_expert_host`.
   * low-latency (equal splits, no host sync): when the step's `max_tokens_per_rank` bound is
     at most `low_latency_max_tokens` (DeepEP's decode regime), every (source, destination)
     pair exchanges a fixed region of `R = max_tokens_per_rank * min(K, L)` rows, zero-padded:
     a token sends at most min(K, L) rows to one rank. Slots are computed on the device, so the
     step is free of host syncs (and of data-dependent shapes) at the cost of sending padding.

Ordering. Rows arrive grouped by source rank, then local expert, each group in the sender's
(token, k) order (then padding, in low-latency mode). dispatch() regroups them stably by local
expert, so rows come out EXPERT_MAJOR: per expert, the source ranks in order, each in its token
order -- exactly the rows, in exactly the order, `local` would give each expert on the ranks'
tokens concatenated in rank order -- then the padding rows at the end. combine() reverses both
steps, puts each pair's row back at `t * K + k` and reduces with `weighted_sum`, so for equal
expert outputs its result equals `local`'s bit for bit, whatever the placement or mode.

Steps. Every collective is issued with `async_op=True`; `dispatch_steps` and `combine_steps`
yield while one is in flight and wait on it when resumed, so a driver (two-batch overlap) can
compute the other micro-batch meanwhile. dispatch() and combine() are those steps run to the end
(`finish`): one code path, the same bytes either way.

FP8 (`dispatch_fp8`): the payload rows are the packed FP8 rows (`fp8.encode_rows`, int32 words)
instead of the hidden rows, moved by the same code; the received rows are unpacked
(`fp8.decode_rows`) after the regrouping, and handed over as they came and dequantised.
Low-latency padding rows are zero words, which dequantise to zeros. combine() is unchanged: it
moves the experts' outputs in their own dtype.

Everything else stays on the tensors' device, so the same code runs on gloo (CPU) and NCCL
(GPU); gloo carries float32, float16 and bfloat16 rows as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.dispatch.base import DispatchHandle, DispatchLayout, DispatchOutput, SteppedDispatcher, Steps
from moeserve.dispatch.combine import weighted_sum
from moeserve.dispatch.counts import count_per_expert
from moeserve.dispatch.fp8 import decode_rows, encode_rows
from moeserve.dispatch.placement import ExpertPlacement

LOW_LATENCY_MAX_TOKENS = 128  # tokens per rank up to which the equal-split mode is used (DeepEP's decode bound)


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    """What combine() needs to send expert outputs home and reduce them.

    send_row:      int64 `[T*K]`: each pair's row (pair `t*K + k`) in the send buffer, and so in
                   the buffer combine() receives back.
    num_send_rows: rows of that buffer.
    recv_order:    int64 `[N]`: for each row of DispatchOutput.hidden, its row in the received buffer.
    splits:        (send, receive) split sizes of the uneven mode; None for equal splits.
    topk_ids, topk_weights: dispatch()'s inputs, for `weighted_sum`.
    """

    send_row: torch.Tensor
    num_send_rows: int
    recv_order: torch.Tensor
    splits: tuple[list[int], list[int]] | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class AllToAllDispatcher(SteppedDispatcher):
    """Expert-parallel dispatch over an EP process group of `placement.ep_size` ranks."""

    name = "torch"

    def __init__(
        self,
        placement: ExpertPlacement,
        group: dist.ProcessGroup | None = None,
        low_latency_max_tokens: int = LOW_LATENCY_MAX_TOKENS,
        dispatch_fp8: bool = False,
    ) -> None:
        """group: the EP process group (None: the default group); its ranks are the placement's ranks.
        low_latency_max_tokens: the largest step bound served by the equal-split mode (0: never).
        dispatch_fp8: send FP8 rows with per-128-channel scales (see the module docstring)."""
        super().__init__(placement, dispatch_fp8)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != placement.ep_size:
            raise ValueError(
                f"the placement spreads experts over ep_size={placement.ep_size} ranks but the process group has {size}"
            )
        if rank != placement.rank:
            raise ValueError(
                f"the placement is seen from rank {placement.rank} but this process is rank {rank} of its group"
            )
        self.group = group
        self.low_latency_max_tokens = low_latency_max_tokens
        self._expert_slot = placement.expert_slot  # moved to the tokens' device on first use

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if not dist.is_initialized():
            return "torch.distributed is not initialised (call init_process_group first)"
        return None

    def syncs_host(self, max_tokens_per_rank: int | None) -> bool:
        """True in the uneven (high-throughput) mode: no bound, or one above `low_latency_max_tokens`."""
        return max_tokens_per_rank is None or max_tokens_per_rank > self.low_latency_max_tokens

    def dispatch_steps(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> Steps[DispatchOutput]:
        """dispatch() in steps (EXPERT_MAJOR rows, padding at the end in low-latency mode): each
        collective is issued asynchronously and the generator yields while it is in flight.
        Uneven mode: counts, yield, the host read, payload, yield (the split sizes need the
        counts). Low-latency mode: the payload's slots need only this rank's own counts, so counts
        and payload are issued together and it yields once. The number of yields depends only on
        the mode, which the step bound decides alike on every rank."""
        num_tokens, top_k = topk_ids.shape
        if max_tokens_per_rank is not None and num_tokens > max_tokens_per_rank:
            raise ValueError(f"{num_tokens} tokens exceed this step's max_tokens_per_rank={max_tokens_per_rank}")
        ep, lmax = self.placement.ep_size, self.placement.max_local_experts
        num_pairs, device = num_tokens * top_k, topk_ids.device
        if self._expert_slot.device != device:
            self._expert_slot = self._expert_slot.to(device)
        slot = self._expert_slot[topk_ids.reshape(-1)]  # [T*K]: dest rank * L + local expert there
        send_order = torch.argsort(slot, stable=True)
        send_position = torch.empty_like(send_order)  # each pair's position in the sorted order
        send_position[send_order] = torch.arange(num_pairs, device=device)
        send_counts = count_per_expert(slot, ep * lmax).view(ep, lmax)
        recv_counts = torch.empty_like(send_counts)
        counts_sent = dist.all_to_all_single(recv_counts, send_counts, group=self.group, async_op=True)

        host_counts, splits = None, None
        if self.syncs_host(max_tokens_per_rank):
            yield  # the counts are in flight; the split sizes need them
            counts_sent.wait()
            host_send, host_recv = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync
            splits = ([sum(row) for row in host_send], [sum(row) for row in host_recv])
            host_counts = tuple(sum(column) for column in zip(*host_recv))[: self.placement.num_local_experts]
            send_row, num_send, num_recv = send_position, num_pairs, sum(splits[1])
        else:
            region = max_tokens_per_rank * min(top_k, lmax)  # rows per (source, destination) pair
            per_dest = send_counts.sum(1)
            dest = slot // lmax
            send_row = dest * region + send_position - (torch.cumsum(per_dest, 0) - per_dest)[dest]
            num_send = num_recv = ep * region

        # Low-latency padding rows are zeros, so the experts see finite values there.
        payload = encode_rows(hidden) if self.dispatch_fp8 else hidden  # [T, H], or FP8 words [T, W]
        send = (payload.new_zeros if splits is None else payload.new_empty)(num_send, payload.shape[-1])
        send.index_copy_(0, send_row, payload.repeat_interleave(top_k, dim=0))
        recv = payload.new_empty(num_recv, payload.shape[-1])
        recv_splits, send_splits = (splits[1], splits[0]) if splits else (None, None)  # None: equal splits
        payload_sent = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)
        yield  # the payload (and, in low-latency mode, the counts) in flight
        if splits is None:
            counts_sent.wait()
            recv_padding = region - recv_counts.sum(1)
        else:
            recv_padding = torch.zeros(ep, dtype=torch.int64, device=device)
        payload_sent.wait()

        # Received rows are (source, expert)-major, each source's padding last; a stable sort by
        # expert (padding as expert L) makes them expert-major with all padding at the end.
        per_group = torch.cat([recv_counts, recv_padding[:, None]], 1).reshape(-1)  # [ep * (L + 1)]
        group_expert = torch.arange(lmax + 1, device=device).repeat(ep)
        row_expert = torch.repeat_interleave(group_expert, per_group, output_size=num_recv)
        recv_order = torch.argsort(row_expert, stable=True)
        handle = AllToAllHandle(
            num_tokens=num_tokens,
            send_row=send_row,
            num_send_rows=num_send,
            recv_order=recv_order,
            splits=splits,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
        )
        received = recv.index_select(0, recv_order)
        fp8_rows = decode_rows(received, hidden.shape[-1]) if self.dispatch_fp8 else None
        return DispatchOutput(
            hidden=received if fp8_rows is None else fp8_rows.dequantize(hidden.dtype),
            fp8_rows=fp8_rows,
            num_tokens_per_expert=recv_counts.sum(0)[: self.placement.num_local_experts],
            num_tokens_per_expert_host=host_counts,
            layout=DispatchLayout.EXPERT_MAJOR,
            handle=handle,
        )

    def combine_steps(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Steps[torch.Tensor]:
        """combine() in steps: the one collective is issued asynchronously, then it yields once."""
        assert isinstance(handle, AllToAllHandle), f"torch combine got a {type(handle).__name__}"
        if expert_output.shape[0] != handle.recv_order.numel():
            raise ValueError(
                f"combine got {expert_output.shape[0]} rows; dispatch handed out {handle.recv_order.numel()}"
            )
        # Back to the received layout, so each source rank's rows are one contiguous split again.
        send = torch.empty_like(expert_output).index_copy_(0, handle.recv_order, expert_output)
        returned = expert_output.new_empty(handle.num_send_rows, expert_output.shape[-1])
        returned_splits, send_splits = handle.splits or (None, None)
        sent = dist.all_to_all_single(returned, send, returned_splits, send_splits, group=self.group, async_op=True)
        yield  # the expert outputs in flight home
        sent.wait()
        return weighted_sum(
            returned.index_select(0, handle.send_row), handle.topk_ids, handle.topk_weights, handle.sum_order
        )
