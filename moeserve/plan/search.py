"""The layouts worth renting: every split of the GPUs the runtime can run, screened by the cost
model, the most promising simulated under the SLOs.

Two passes, so the command answers in seconds: (1) every candidate deployment (EP size, TP size
of attention, prefill/decode split, TBO on/off, batch cap, prefill chunk) is checked to fit in
memory and priced analytically (`serving.capacity`: full batches, no queueing); those whose
full-batch decode step already breaks the TBT target are dropped; (2) the `simulate` best by
that price are simulated (`serving.serve`) and ranked by goodput, then tokens/s per GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moeserve.plan.cost import Layout
from moeserve.plan.hardware import Hardware
from moeserve.plan.serving import Deployment, ServingResult, Workload, capacity, fits, serve, step_times
from moeserve.plan.shapes import ModelShape

BATCH_CAPS = (8, 16, 32, 64, 128, 256)
CHUNKS = (128, 512, 2048)
PREFILL_CHUNK = 8192
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; `nodes` only bounds TP to one node's GPUs."""

    gpus: int
    nodes: int = 1
    disaggregate: bool = True
    tbo: tuple[bool, ...] = (False, True)
    num_comm_sms: int = 20
    expert_imbalance: float = 1.2
    dispatch_fp8: bool = True
    batch_caps: tuple[int, ...] = BATCH_CAPS
    chunks: tuple[int, ...] = CHUNKS
    simulate: int = 8

    @property
    def gpus_per_node(self) -> int:
        if self.gpus % self.nodes:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --nodes {self.nodes}")
        return self.gpus // self.nodes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, space: SearchSpace, ep_limit: int) -> list[Layout]:
    """EP groups up to `ep_limit` GPUs: TP of attention within a node and dividing the heads it
    splits (`ModelShape.splits_over`)."""
    out = []
    for ep in _divisors(ep_limit):
        for tp in TP_SIZES:
            if ep % tp or tp > space.gpus_per_node or not shape.splits_over(tp):
                continue
            for tbo in space.tbo if ep > 1 else (False,):
                out.append(
                    Layout(
                        ep=ep,
                        tp=tp,
                        tbo=tbo,
                        dispatch_fp8=space.dispatch_fp8,
                        num_comm_sms=space.num_comm_sms if tbo else 0,
                        expert_imbalance=space.expert_imbalance if ep > 1 else 1.0,
                    )
                )
    return out


def deployments(shape: ModelShape, space: SearchSpace) -> list[Deployment]:
    """Colocated: N / ep instances of one layout. Split: P GPUs of prefill instances and N - P of
    decode instances, each side one layout; on several nodes each side takes whole nodes (the
    KV transfer between them goes over the NIC either way)."""
    out = []
    for layout in layouts(shape, space, space.gpus):
        if space.gpus % layout.ep:
            continue
        for cap, chunk in itertools.product(space.batch_caps, space.chunks):
            out.append(Deployment(layout, space.gpus // layout.ep, cap, chunk))
    if not space.disaggregate:
        return out
    unit = space.gpus_per_node if space.nodes > 1 else 1  # across nodes, each side takes whole nodes
    for prefill_gpus in range(unit, space.gpus, unit):
        decode_gpus = space.gpus - prefill_gpus
        for pre, dec in itertools.product(layouts(shape, space, prefill_gpus), layouts(shape, space, decode_gpus)):
            if prefill_gpus % pre.ep or decode_gpus % dec.ep:
                continue
            for cap in space.batch_caps:
                out.append(Deployment(dec, decode_gpus // dec.ep, cap, PREFILL_CHUNK, pre, prefill_gpus // pre.ep))
    return out


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    capacity: float
    """Requests/s at full batches."""
    tok_s_per_gpu: float
    tbt_s: float
    """A token's wait in a full-batch step (with a prefill chunk, colocated)."""


def screen(
    shape: ModelShape, hw: Hardware, space: SearchSpace, workload: Workload, slo_tbt_s: float
) -> list[Candidate]:
    """Every deployment that fits and whose full-batch step keeps the TBT target, priced, best
    first."""
    out = []
    for dep in deployments(shape, space):
        if not fits(shape, hw, dep, workload):
            continue
        dec = step_times(shape, hw, dep.decode, workload)
        worst_step = dec.seconds(dep.max_batch, 0 if dep.prefill else dep.chunk)
        tbt = worst_step / workload.tokens_per_step
        if tbt > slo_tbt_s:
            continue
        cap = capacity(shape, hw, dep, workload)
        out.append(Candidate(dep, cap, cap * workload.osl / dep.gpus, tbt))
    return sorted(out, key=lambda c: -c.tok_s_per_gpu)


def search(
    shape: ModelShape, hw: Hardware, space: SearchSpace, workload: Workload, slo_ttft_s: float, slo_tbt_s: float
) -> list[ServingResult]:
    """The screened best, simulated, ranked by goodput then tokens/s per GPU."""
    candidates = screen(shape, hw, space, workload, slo_tbt_s)[: space.simulate]
    results = [serve(shape, hw, c.deployment, workload, slo_ttft_s, slo_tbt_s) for c in candidates]
    return sorted(results, key=lambda r: (-r.goodput_tok_s_per_gpu, -r.tok_s_per_gpu))
