"""One rank: its experts, its share of attention, and the step loop.

    python -m moeserve.distributed.worker --master-addr A --master-port P --rank R --local-rank L --node-rank N

Started by node 0 (its own ranks) or by `moeserve launch --node-rank N` on other machines.
The rank reads everything else (model, dtype, layout, KV blocks) from node 0's store, so every
rank builds exactly what node 0's schedulers plan with. Any failure is written to the store
for node 0 to report, and the process exits non-zero without waiting on anyone.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moeserve.dispatch import DispatchRows, ExpertMap, ep_dispatcher
from moeserve.dispatch.expert_load import logical_rows
from moeserve.distributed.channel import ControlClient
from moeserve.distributed.messages import (
    LoadReport,
    Regroup,
    RegroupDone,
    Shutdown,
    StepBitmask,
    StepFailed,
    StepInput,
    StepOutput,
    Sync,
    SyncAck,
    WorkerSpec,
)
from moeserve.distributed.rendezvous import (
    CONTROL_KEY,
    RANKS_PREFIX,
    SPEC_KEY,
    Heartbeat,
    connect_store,
    error_key,
    get,
)
from moeserve.distributed.returning import AwaitingGroup, is_returning
from moeserve.eplb import Rebalancer, Recovered, recover_layer, recovery_plan, survivor_map
from moeserve.kv_transfer.agent import KvAgent
from moeserve.kv_transfer.rank_writer import serve_writes
from moeserve.models import TensorParallel, load_model, model_config
from moeserve.models.loader import ExpertReader, weight_bytes
from moeserve.ops import create_ops
from moeserve.worker.decode_graphs import GraphSettings, create_decode_graphs, is_decode
from moeserve.worker.kv_cache import allocate_kv_caches, bytes_per_block, state_bytes
from moeserve.worker.runner import ModelRunner
from moeserve.worker.sampling_metadata import PendingBitmask, TokenBitmask
from moeserve.worker.two_batch import micro_batch_bounds

logger = logging.getLogger("moeserve.worker")

POLL_S = 0.5  # how often an idle rank looks up from the channel (nothing to do but wait)


def collective_backend(spec: WorkerSpec) -> str:
    if spec.parallel.backend != "auto":
        return spec.parallel.backend
    return "nccl" if spec.device.startswith("cuda") else "gloo"


def rank_device(spec: WorkerSpec, local_rank: int) -> torch.device:
    """One GPU per rank (the node's `local_rank`-th); on CPU the node's cores are shared out."""
    if spec.device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if local_rank >= visible:  # launchers refuse such a layout first; this names it if one slips through
            raise RuntimeError(
                f"local rank {local_rank} needs CUDA device {local_rank} but this node shows {visible}: "
                "every rank needs a GPU of its own (see moeserve.engine_config.rank_devices_problem)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // spec.parallel.ranks_per_node))
    return torch.device(spec.device)


class Worker:
    """`member`: the rank this process was launched as, the name node 0 and the store know it by
    (its heartbeat, its error); `rank`: its place in the current process group, the same until a
    `regroup` forms a smaller group (lost ranks) or a larger one (returned ranks).

    returning: this process restarts a lost rank (`distributed.returning`): it joins no group
    until node 0's `Regroup` takes it in, and runs no step before."""

    def __init__(
        self,
        spec: WorkerSpec,
        rank: int,
        node_rank: int,
        device: torch.device,
        store: dist.Store,
        returning: bool = False,
    ) -> None:
        p = spec.parallel
        self.spec, self.rank, self.node_rank, self.device, self.store = spec, rank, node_rank, device, store
        self.member = rank
        self.serving = not returning
        if returning:  # heal needs tp 1: the rank is its own data-parallel group
            self.group_index, self.tp = rank, TensorParallel(0, 1, None)
            return
        self._join_group(RANKS_PREFIX, rank, p.ep)
        self.group_index, tp_rank = divmod(rank, p.tp)
        tp_group = None
        for g in range(p.num_dp_groups):  # every rank creates every group, in the same order
            members = list(range(g * p.tp, (g + 1) * p.tp))
            group = dist.new_group(members) if p.tp > 1 else None
            if g == self.group_index:
                tp_group = group
        self.tp = TensorParallel(tp_rank, p.tp, tp_group)

    def _join_group(self, prefix: str, rank: int, world_size: int) -> None:
        dist.init_process_group(
            collective_backend(self.spec),
            store=dist.PrefixStore(prefix, self.store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=self.spec.parallel.collective_timeout_s),
        )

    def leave_group(self) -> None:
        """Close this rank's connections to its peers (idempotent). After a failed step, at once:
        a peer still waiting on this rank in a collective then fails too instead of hanging, so
        every survivor gets out of the broken step."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def regroup(self, message: Regroup) -> RegroupDone:
        """Form the group of `message.generation` and take the expert slots the new map gives
        this rank (see `eplb.survivors`): after lost ranks their slots, after a return the share
        it takes back. Group rank 0, which held the old group's map, shares it and its EPLB step
        count (a returned rank has neither). Stage times are logged."""
        started = time.perf_counter()
        self.leave_group()
        rank = message.members.index(self.member)
        self._join_group(f"{RANKS_PREFIX}/{message.generation}", rank, len(message.members))
        shared = [self.expert_map, self.rebalancer.window.steps if self.rebalancer is not None else 0]
        dist.broadcast_object_list(shared, src=0)
        old_map, eplb_steps = shared
        regrouped = time.perf_counter()
        new_map = survivor_map(old_map, message.previous)
        model = self.runner.model
        self._routed = None  # counted under the old group, as node 0's copy is dropped; `rehome` zeroes the counters
        placement = new_map.slot_placement(rank)
        dispatcher = ep_dispatcher(self.spec.parallel, placement, self.device, dist.group.WORLD, self.rows)
        weights, recovered = _recover_experts(model, old_map, new_map, message.previous, rank, self.spec)
        model.rehome(dispatcher, weights, new_map, rank)
        if message.forget_requests:
            self.runner.forget_requests()
        self.rank, self.group_index, self.expert_map = rank, rank, new_map
        if self.rebalancer is not None:
            self.rebalancer.expert_map, self.rebalancer.rank, self.rebalancer.group = new_map, rank, dist.group.WORLD
            if not self.serving:  # rebalance at the same steps as the others, from its own loads on
                self.rebalancer.window.restart_at(eplb_steps)
        self.serving = True
        done_at = time.perf_counter()
        logger.info(
            "rank %d is group rank %d of %d (generation %d): regrouped in %.3f s; %d expert slots from peers, "
            "%d from the checkpoint (%.2f MiB) in %.3f s",
            self.member,
            rank,
            len(message.members),
            message.generation,
            regrouped - started,
            recovered.peer_slots,
            recovered.checkpoint_slots,
            (recovered.peer_bytes + recovered.checkpoint_bytes) / 2**20,
            done_at - regrouped,
        )
        return RegroupDone(
            message.generation,
            self.member,
            rank,
            regroup_s=regrouped - started,
            experts_s=done_at - regrouped,
            peer_slots=recovered.peer_slots,
            checkpoint_slots=recovered.checkpoint_slots,
            peer_bytes=recovered.peer_bytes,
            checkpoint_bytes=recovered.checkpoint_bytes,
        )

    def load(self) -> LoadReport:
        spec = self.spec
        cfg, eplb = model_config(spec.model, spec.indexer_key_dtype), spec.parallel.eplb
        self.expert_map = ExpertMap.initial(
            cfg.num_experts,
            len(cfg.moe_layer_indices),
            spec.parallel.ep,
            eplb.num_redundant_experts,
            eplb.expert_placement,
        )
        placement = self.expert_map.slot_placement(self.rank)
        # Known before the weights: a dispatcher that allocates its buffers does so here, at startup.
        self.rows = DispatchRows(cfg.hidden_size, cfg.router.top_k, spec.dtype)
        if self.serving:
            dispatcher = ep_dispatcher(spec.parallel, placement, self.device, dist.group.WORLD, self.rows)
        else:
            dispatcher = AwaitingGroup(placement, spec.parallel.dispatch_fp8)
        model = load_model(
            Path(spec.model),
            spec.dtype,
            self.device,
            dispatcher,
            self.tp,
            create_ops(spec.kernels, self.device),
            self.expert_map,
            with_mtp=spec.mtp_drafts > 0,
            indexer_key_dtype=spec.indexer_key_dtype,
        )
        # One block more when decode graphs may be captured: their pad rows' scratch block.
        scratch = 1 if spec.cuda_graphs.wanted(str(self.device)) else 0
        kv_caches = allocate_kv_caches(
            model.cfg,
            spec.num_kv_blocks + scratch,
            spec.block_size,
            spec.dtype,
            self.device,
            self.tp.size,
            len(model.mtp),
            num_state_slots=spec.max_num_seqs,
            draft_states=spec.draft_states,
            num_saved_states=spec.saved_states,
            max_num_batched_tokens=spec.max_num_batched_tokens,
        )
        settings = GraphSettings(
            str(self.device),
            spec.max_num_seqs,
            spec.max_model_len,
            tp_size=self.tp.size,
            two_batch_overlap=spec.parallel.two_batch_overlap,
            eplb=eplb.enabled,
        )
        graphs = create_decode_graphs(model, kv_caches, spec.block_size, spec.num_kv_blocks, spec.cuda_graphs, settings)
        self.kv_agent = KvAgent(kv_caches, f"rank{self.rank}") if spec.kv_transfer else None
        self.kv_writes = None
        if self.kv_agent is not None and spec.kv_write_host and self.tp.rank == 0:
            self.kv_writes = serve_writes(self.kv_agent, spec.kv_write_host)
        self.runner = ModelRunner(
            model,
            kv_caches,
            spec.block_size,
            spec.eos_token_ids,
            self.device,
            seed=spec.seed,
            lockstep=True,
            samples=self.tp.rank == 0,
            two_batch_overlap=spec.parallel.two_batch_overlap,
            graphs=graphs,
            mtp_drafts=spec.mtp_drafts,
        )
        self.rebalancer = None
        if eplb.enabled:
            self.rebalancer = Rebalancer(
                model,
                self.expert_map,
                self.rank,
                eplb.window_steps,
                eplb.interval_steps,
                spec.parallel.nnodes,
                dist.group.WORLD,
            )
        self._routed: list[list[int]] | None = None  # rows counted under a map since replaced
        sizes = weight_bytes(model)
        if self.runner.grouped:  # a pool per block-table group: what was allocated
            kv_bytes = sum(t.nbytes for cache in kv_caches for t in cache.tensors)
        else:
            paged = spec.num_kv_blocks * bytes_per_block(
                model.cfg, spec.block_size, spec.dtype, self.tp.size, len(model.mtp)
            )
            states = state_bytes(
                model.cfg, spec.dtype, spec.max_num_seqs, self.tp.size, spec.draft_states, spec.saved_states
            )
            kv_bytes = paged + states
        return LoadReport(
            rank=self.rank,
            node_rank=self.node_rank,
            pid=os.getpid(),
            host=socket.gethostname(),
            num_local_experts=placement.num_local_experts,
            expert_bytes=sizes.experts,
            other_bytes=sizes.other,
            kv_bytes=kv_bytes,
            dispatcher=dispatcher.name,
            decode_graph_sizes=graphs.sizes if graphs is not None else (),
            kv_registration=self.kv_agent.registration if self.kv_agent is not None else None,
            kv_writer=self.kv_writes.address if self.kv_writes is not None else None,
        )

    def step(self, message: StepInput, receive_bitmask: Callable[[int], TokenBitmask]) -> StepOutput:
        """Run this rank's part of a step; `receive_bitmask(step)` reads the grammar bitmask the
        engine sends after the plan (`message.bitmask_follows`), when the sampler needs it."""
        # Every rank sees every group's plan, so all agree on this bound without communicating.
        bound = max(self.tp.largest_slice(plan.num_batched_tokens) for plan in message.plans)
        micro_bounds = None
        if self.spec.parallel.two_batch_overlap:
            steps = [[len(s.token_ids) for s in plan.scheduled] for plan in message.plans]
            micro_bounds = micro_batch_bounds(steps, self.tp)
        decode_only = all(is_decode(plan.scheduled) for plan in message.plans)  # the same on every rank
        bitmask = PendingBitmask(lambda: receive_bitmask(message.step)) if message.bitmask_follows else None
        sampled = self.runner.execute(message.plans[self.group_index], bound, micro_bounds, decode_only, bitmask)
        if bitmask is not None:
            bitmask.get()  # read it off the channel even where this rank did not sample
        report = None
        if message.profile:
            self._forget_routing()
        elif self.rebalancer is not None and self.rebalancer.record():
            report = self.rebalancer.rebalance(before_swap=self._set_aside_routed)
            self.expert_map = self.rebalancer.expert_map
            if self.rank == 0:
                logger.info("%s", report.describe())
        routed = wire = None
        # A rebalance closes the load report: what was counted under the old map goes out with
        # the step that ends it (the engine publishes it at once), so the next report covers
        # only steps under the new map.
        if message.want_routed_tokens or report is not None:
            self._set_aside_routed(self.expert_map)
            routed, self._routed = self._routed, None
            wire = self.runner.model.take_dispatch_rows()
        return StepOutput(
            message.step,
            self.rank,
            sampled,
            routed,
            wire,
            report if self.rank == 0 else None,
            self.runner.take_prompt_logprobs(),
        )

    def _forget_routing(self) -> None:
        """A profile step's routing is not traffic: its counters are dropped, and the EPLB window
        restarts empty at the step count it had (the profile runs before any served step)."""
        self.runner.model.take_routed_tokens()
        self.runner.model.take_dispatch_rows()
        if self.rebalancer is not None:
            self.rebalancer.window.restart_at(self.rebalancer.window.steps)

    def _set_aside_routed(self, expert_map: ExpertMap) -> None:
        """Read the per-slot counters and add them, per logical expert under `expert_map` (the
        map they were counted under), to what the next report carries."""
        counted = logical_rows(self.runner.model.take_routed_tokens(), expert_map, self.rank)
        if self._routed is None:
            self._routed = counted
            return
        for total, rows in zip(self._routed, counted):
            for e, n in enumerate(rows):
                total[e] += n


def _recover_experts(
    model, old_map: ExpertMap, new_map: ExpertMap, previous: tuple[int | None, ...], rank: int, spec: WorkerSpec
) -> tuple[list[dict[str, torch.Tensor]], Recovered]:
    """Each MoE layer's new expert parameters for group rank `rank` (`eplb.recovery`), by name."""
    reader = ExpertReader(spec.model, spec.dtype)
    recovered, weights = Recovered(), []
    try:
        for i, block in enumerate(model.moe_blocks()):
            # Every tensor of the experts: a quantized one's stored bytes and scales as well.
            named = list(block.experts.named_parameters())
            names, params = [name for name, _ in named], [param for _, param in named]

            def read(
                experts: list[int], i: int = i, module: nn.Module = block.experts, names: list[str] = names
            ) -> list[torch.Tensor]:
                held = reader.read(i, module, experts)
                return [held[name] for name in names]

            plan = recovery_plan(old_map, new_map, previous, i)
            fresh, done = recover_layer(params, plan, rank, read, tag=len(names) * i)
            recovered.add(done)
            weights.append(dict(zip(names, fresh)))
    finally:
        reader.close()
    return weights, recovered


def serve_rank(
    master_addr: str, master_port: int, rank: int, local_rank: int, node_rank: int, parent_pid: int | None
) -> None:
    """Join, load, then run steps until node 0 says stop. Raises on any failure."""
    store = connect_store(master_addr, master_port, timeout_s=600.0)

    def orphaned(reason: str) -> None:
        logger.error("rank %d: %s; exiting", rank, reason)
        logging.shutdown()
        os._exit(1)

    Heartbeat(connect_store(master_addr, master_port, timeout_s=30.0), rank, parent_pid, orphaned)
    spec: WorkerSpec = get(store, SPEC_KEY)
    channel = ControlClient(*get(store, CONTROL_KEY))
    device = rank_device(spec, local_rank)
    returning = is_returning(store)
    if returning:
        logger.info("rank %d comes back into a running engine: it joins the ranks' group once loaded", rank)
    worker = Worker(spec, rank, node_rank, device, store, returning)
    try:
        report = worker.load()
    except Exception as exc:  # noqa: BLE001 - node 0 reports it; this rank cannot serve
        channel.send(
            LoadReport(rank, node_rank, os.getpid(), socket.gethostname(), error=f"{type(exc).__name__}: {exc}")
        )
        raise
    channel.send(report)
    heals = spec.parallel.on_rank_failure == "heal"

    def receive_bitmask(step: int) -> TokenBitmask:
        while True:
            message = channel.receive(POLL_S)
            if message is None:
                continue
            if not isinstance(message, StepBitmask) or message.step != step:
                raise RuntimeError(f"expected step {step}'s grammar bitmask, got {type(message).__name__}")
            return message.token_bitmask

    while True:
        message = channel.receive(POLL_S)
        if message is None:
            continue
        if isinstance(message, Shutdown):
            break
        if isinstance(message, Sync):
            channel.send(SyncAck(worker.rank, worker.member))
            continue
        if isinstance(message, StepBitmask):
            continue  # the mask of a step this rank abandoned (it failed before sampling)
        if isinstance(message, Regroup):
            if worker.member in message.members:
                channel.send(_regroup(worker, message, channel))
            continue
        if not worker.serving:
            continue  # a step of the group this returned rank has not joined yet
        if not heals:
            channel.send(worker.step(message, receive_bitmask))
            continue
        try:
            output = worker.step(message, receive_bitmask)
        except Exception as exc:  # noqa: BLE001 - node 0 decides: heal if a rank is lost, else stop
            worker.leave_group()
            logger.warning("rank %d: step %d failed (%s); waiting for node 0", rank, message.step, exc)
            channel.send(StepFailed(message.step, rank, f"{type(exc).__name__}: {exc}"))
            continue
        channel.send(output)
    channel.close()
    worker.leave_group()


def _regroup(worker: Worker, message: Regroup, channel: ControlClient) -> RegroupDone:
    """`worker.regroup`, or its failure told to node 0 before this rank dies of it."""
    try:
        return worker.regroup(message)
    except Exception as exc:
        channel.send(RegroupDone(message.generation, worker.member, -1, error=f"{type(exc).__name__}: {exc}"))
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moeserve-worker", description="one expert-parallel rank (started by moeserve launch)"
    )
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [rank {args.rank}] %(name)s: %(message)s",
    )
    try:
        serve_rank(args.master_addr, args.master_port, args.rank, args.local_rank, args.node_rank, args.parent_pid)
    except Exception:  # noqa: BLE001 - leave the reason where node 0 can read it, then die
        text = traceback.format_exc()
        logger.error("rank %d failed:\n%s", args.rank, text)
        try:
            connect_store(args.master_addr, args.master_port, timeout_s=5.0).set(
                error_key(args.rank), text.strip().splitlines()[-1]
            )
        except Exception:  # noqa: BLE001 - node 0 is gone too; the log has it
            pass
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # skip interpreter teardown: the process group's threads may still hold sockets


if __name__ == "__main__":
    sys.exit(main())
