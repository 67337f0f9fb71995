"""`torch` backend: expert parallelism over `torch.distributed.all_to_all_single` (gloo or NCCL).

Wire format. dispatch() makes two collectives over the EP group:

1. counts: an int64 tensor `[ep, max_local_experts]` per rank, row `r` holding how many of this
   rank's (token, k) pairs go to each local expert of rank `r` (padded with zeros where `r` holds
   fewer experts). One equal-split all_to_all_single turns it into the counts this rank receives
   from every source rank, per local expert.
2. payload: the hidden rows themselves, in their own dtype, one row per (token, k) pair, with
   uneven `input_split_sizes` / `output_split_sizes` (zero allowed) taken from those counts.

Why two: an uneven all-to-all needs both sides to know every split before it starts, so the
counts must travel first; sending them per expert rather than per rank also tells the receiver
which expert each row belongs to, so no expert ids travel with the rows. Reading the received
counts back with `.tolist()` is a host sync (once per dispatch, for the split sizes and
`num_tokens_per_expert`); this backend accepts it. Everything else stays on the tensors' device,
so the same code runs on gloo (CPU) and NCCL (GPU). gloo carries float32, float16 and bfloat16
rows as they are, so no dtype conversion happens on the wire.

Ordering. Each rank sends its pairs stably sorted by (destination rank, local expert there), so
rows arrive grouped by source rank, then expert, each group in the sender's (token, k) order.
dispatch() regroups them stably by local expert, then source rank. With the source ranks'
tokens concatenated in rank order, that is exactly the row order `local` would hand each expert,
so the experts see identical matrices. combine() reverses both steps and reduces each token's k
rows in `local`'s pair order (ascending global expert id), with `local`'s arithmetic, so for
equal expert outputs the result equals `local`'s bit for bit, whatever the placement.

A rank with no tokens still joins both collectives (with zero splits); every rank of the group
must call dispatch() and combine() the same number of times, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.dispatch.base import DispatchHandle, Dispatcher, DispatchOutput
from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    """What combine() needs to send expert outputs home and reduce them.

    send_splits:   rows sent to each rank by dispatch(); combine() receives as many back.
    recv_splits:   rows received from each rank by dispatch(); combine() sends as many back.
    recv_order:    `[N_recv]` for each row of DispatchOutput.hidden, its row in the received
                   buffer (grouped by source rank, then expert).
    combine_rows:  `[T*K]` for each pair in `local`'s order, its row in the buffer combine()
                   receives (send order); None where the two orders coincide (the placement
                   gives ranks ascending runs of experts, e.g. the contiguous one).
    src_token:     `[T*K]` source token of each pair, in `local`'s order.
    weights:       `[T*K]` float32 top-k weight of each pair, in `local`'s order.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_order: torch.Tensor
    combine_rows: torch.Tensor | None
    src_token: torch.Tensor
    weights: torch.Tensor


class AllToAllDispatcher(Dispatcher):
    """Expert-parallel dispatch over an EP process group of `placement.ep_size` ranks."""

    name = "torch"

    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None = None) -> None:
        """group: the EP process group (None: the default group); its ranks are the placement's ranks."""
        super().__init__(placement)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != placement.ep_size:
            raise ValueError(f"the placement spreads experts over ep_size={placement.ep_size} ranks but the process group has {size}")
        if rank != placement.rank:
            raise ValueError(f"the placement is seen from rank {placement.rank} but this process is rank {rank} of its group")
        self.group = group
        per_rank = [placement.experts_of(r) for r in range(placement.ep_size)]
        self.max_local_experts = max(len(experts) for experts in per_rank)
        slot = [0] * placement.num_experts  # global expert -> dest rank * max_local_experts + local index there
        for r, experts in enumerate(per_rank):
            for local_index, expert in enumerate(experts):
                slot[expert] = r * self.max_local_experts + local_index
        self.expert_slot = torch.tensor(slot, dtype=torch.int64)
        # Slots ascend with the expert id iff owners do; then send order already is local's order.
        self.send_order_is_expert_order = list(placement.expert_to_rank) == sorted(placement.expert_to_rank)

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if not dist.is_initialized():
            return "torch.distributed is not initialised (call init_process_group first)"
        return None

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        num_tokens, top_k = topk_ids.shape
        ep, max_local = self.placement.ep_size, self.max_local_experts
        device = topk_ids.device
        flat = topk_ids.reshape(-1)

        if self.expert_slot.device != device:  # once: the table then lives where the tokens do
            self.expert_slot = self.expert_slot.to(device)
        slot = self.expert_slot[flat]  # [T*K]
        send_order = torch.argsort(slot, stable=True)
        send_counts = torch.bincount(slot, minlength=ep * max_local).view(ep, max_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        host_send, host_recv = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync
        send_splits = tuple(sum(row) for row in host_send)
        recv_splits = tuple(sum(row) for row in host_recv)
        num_recv = sum(recv_splits)

        send = hidden.index_select(0, send_order // top_k)
        recv = hidden.new_empty(num_recv, hidden.shape[-1])
        dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=self.group)

        # Received rows are (source rank, expert)-major; a stable sort by expert makes them expert-major.
        row_expert = torch.repeat_interleave(
            torch.arange(max_local, device=device).repeat(ep), recv_counts.reshape(-1), output_size=num_recv
        )
        recv_order = torch.argsort(row_expert, stable=True)

        if self.send_order_is_expert_order:
            pair_order, combine_rows = send_order, None
        else:
            pair_order = torch.argsort(flat, stable=True)
            send_row = torch.empty_like(send_order)
            send_row[send_order] = torch.arange(send_order.numel(), device=device)
            combine_rows = send_row[pair_order]
        handle = AllToAllHandle(
            num_tokens=num_tokens,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_order=recv_order,
            combine_rows=combine_rows,
            src_token=pair_order // top_k,
            weights=topk_weights.reshape(-1)[pair_order],
        )
        num_local = self.placement.num_local_experts
        return DispatchOutput(
            hidden=recv.index_select(0, recv_order),
            num_tokens_per_expert=tuple(sum(column) for column in zip(*host_recv))[:num_local],
            handle=handle,
        )

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        assert isinstance(handle, AllToAllHandle), f"torch combine got a {type(handle).__name__}"
        if expert_output.shape[0] != handle.recv_order.numel():
            raise ValueError(f"combine got {expert_output.shape[0]} rows; dispatch handed out {handle.recv_order.numel()}")
        hidden_size = expert_output.shape[-1]
        # Back to the received layout, so each source rank's rows are one contiguous split again.
        send = expert_output.new_empty(expert_output.shape).index_copy_(0, handle.recv_order, expert_output)
        returned = expert_output.new_empty(sum(handle.send_splits), hidden_size)
        dist.all_to_all_single(returned, send, list(handle.send_splits), list(handle.recv_splits), group=self.group)
        if handle.combine_rows is not None:
            returned = returned.index_select(0, handle.combine_rows)
        # Same arithmetic, same pair order as `local`.
        weighted = returned * handle.weights.to(returned.dtype)[:, None]
        out = returned.new_zeros(handle.num_tokens, hidden_size)
        return out.index_add_(0, handle.src_token, weighted)
