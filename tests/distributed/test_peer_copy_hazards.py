"""What a GPU run of the `nvshmem` backend would hit and the interpreter hides, shown on CPU:

* a dead or stalled peer: every wait is bounded, and the error names the peer and the phase;
* sequence numbers past 2**31: signal words carry a wrapping epoch, not `seq << 32`;
* sequences finishing out of order (two streams): completion is counted per ring slot and credits
  only rise;
* first calls and per-call ints: compiled Triton must not specialize on them;
* a CPU transport in a process whose kernels are compiled: interpreted per launch.

Each test runs its work in a thread with a deadline, so a wait that would spin forever before the
fix fails the test instead of hanging the suite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dispatch_cases import Case, assert_matches_local, case_steps, placement_for

from moeserve.dispatch import DispatchRows, ExpertPlacement, NvshmemDispatcher
from moeserve.dispatch.nvshmem import PeerTimeout
from moeserve.dispatch.nvshmem_layout import SymmetricLayout
from moeserve.dispatch.symmetric import EmulatedWorld, run_lockstep
from moeserve.kernels import peer_copy

ROWS = DispatchRows(hidden_size=16, top_k=2, dtype=torch.float32)


def within(seconds: float, work: Callable[[], Any]) -> Any:
    """`work()`'s value, or its exception, if it finishes within `seconds`; else the test fails."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a wait for a peer is unbounded"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def two_pes(timeout_s: float = 0.5) -> list[NvshmemDispatcher]:
    world = EmulatedWorld(2)
    return [
        NvshmemDispatcher(
            ExpertPlacement.contiguous(4, 2, rank), ROWS, heap=world.heaps[rank], chunk_tokens=8, timeout_s=timeout_s
        )
        for rank in range(2)
    ]


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    return torch.randn(tokens, 16, generator=g), ids, torch.rand(tokens, 2, generator=g)


@pytest.mark.parametrize(
    "bound,phase", [(8, "dispatch receive"), (None, "notify")], ids=["low_latency", "high_throughput"]
)
def test_a_dropped_peer_times_out_naming_it(bound: int | None, phase: str) -> None:
    """Rank 1 never dispatches: rank 0's wait for its rows runs out and says who and where."""
    rank0, _ = two_pes(timeout_s=0.5)
    with pytest.raises(PeerTimeout, match=rf"rank 0: no word from rank 1 for 0.5 s in {phase}"):
        within(60, lambda: rank0.dispatch(*inputs(5), bound))


def test_a_peer_that_stops_before_combine_times_out_naming_it() -> None:
    """Both ranks dispatch; rank 1 dies before its combine: rank 0's combine wait names it."""
    dispatchers = two_pes(timeout_s=0.5)
    sent = [inputs(5, seed=rank) for rank in range(2)]
    received = run_lockstep([d.dispatch_steps(*x, 8) for d, x in zip(dispatchers, sent)])
    out = received[0]
    with pytest.raises(PeerTimeout, match=r"rank 0: no word from rank 1 .* in combine receive"):
        within(60, lambda: dispatchers[0].combine(out.hidden, out.handle))


def test_after_a_timeout_later_waits_return_at_once() -> None:
    """The first timeout is recorded on the device; every later wait sees it and does not spin."""
    rank0, _ = two_pes(timeout_s=1.0)
    with pytest.raises(PeerTimeout):
        within(60, lambda: rank0.dispatch(*inputs(5), 8))
    with pytest.raises(PeerTimeout, match="dispatch receive"):  # the first record is kept
        within(0.9, lambda: rank0.dispatch(*inputs(5), 8))


def test_epochs_wrap_and_never_reach_zero() -> None:
    assert [peer_copy.epoch(s) for s in (1, 2, peer_copy.EPOCHS)] == [1, 2, peer_copy.EPOCHS]
    assert peer_copy.epoch(peer_copy.EPOCHS + 1) == 1  # after 2**31 - 1 sequences, around again
    assert min(peer_copy.epoch(s) for s in range(2**31 - 5, 2**31 + 5)) >= 1


def test_sequence_numbers_past_two_to_the_31_still_match_local() -> None:
    """Sequence numbers start just below 2**31 and cross it during the case: `seq << 32` would
    overflow int64 there and the waits would never see their words (or see wrong counts)."""
    case = Case("E8-k2-past-2**31", 8, 2, "uniform", "contiguous", (5, 3), torch.float32, seed=7)
    world = EmulatedWorld(2)
    dispatchers = [
        NvshmemDispatcher(
            placement_for(case, 2, rank),
            DispatchRows(16, 2, torch.float32),
            heap=world.heaps[rank],
            chunk_tokens=4,
            timeout_s=5,
        )
        for rank in range(2)
    ]
    start = 2**31 - 3
    for d in dispatchers:  # as after days of serving: every earlier sequence sent, read and credited
        d._seq = dict.fromkeys(d._seq, start)
        for region in ("dispatch_credit", "combine_credit"):
            d._buffer.local[d._layout.offsets[region] :].view(torch.int64)[: 2 * d._layout.slots] = start
    results = within(300, lambda: run_lockstep([case_steps(d, case, r, 2) for r, d in enumerate(dispatchers)]))
    assert_matches_local(2, [case], [{"cases": [r]} for r in results], 4)
    assert all(d._seq["dispatch"] > 2**31 and d._seq["combine"] > 2**31 for d in dispatchers)  # crossed it


def _one_pe_recv_buffer() -> tuple[SymmetricLayout, torch.Tensor, torch.Tensor]:
    layout = SymmetricLayout(ep=1, local_experts=2, top_k=1, chunk_tokens=4, row_bytes=16, out_row_bytes=16)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    return layout, buffer, torch.tensor([buffer.data_ptr()], dtype=torch.int64)


def _recv(layout: SymmetricLayout, addresses: torch.Tensor, seq: int) -> None:
    """Copy out sequence `seq`'s (empty) groups of a one-PE buffer, as `dispatch_recv` does."""
    groups, offsets = layout.groups, layout.offsets
    peer_copy.dispatch_recv[(1,)](
        addresses, torch.zeros(groups, dtype=torch.int64), torch.zeros(groups, dtype=torch.int64),
        torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0, seq, seq % layout.slots,
        offsets["dispatch_rows"], offsets["dispatch_meta"], offsets["dispatch_done"], offsets["dispatch_credit"],
        EP=1, L=layout.local_experts, C=layout.chunk_tokens, WORDS=4, BLOCK_M=4, BLOCK_W=4, PUT=0, DOMAIN=1,
    )  # fmt: skip


def _credit(layout: SymmetricLayout, buffer: torch.Tensor, slot: int) -> int:
    """The one PE's credit word for `slot` (credits are per slot: `[S, EP]`)."""
    return int(buffer[layout.offsets["dispatch_credit"] :].view(torch.int64)[slot])


@pytest.mark.parametrize("order", [(4, 5), (5, 4)], ids=["in_order", "out_of_order"])
def test_the_last_group_of_each_slot_credits_its_sequence(order: tuple[int, int]) -> None:
    """Sequences 4 and 5 (slots 0 and 1) copied out in either order: each one's last group sends
    its slot's credit, and neither touches the other slot's. A count over all sequences compared
    with `seq * L` sends none when the newer finishes first; one word for both slots, set by a
    put, would move back."""
    layout, buffer, addresses = _one_pe_recv_buffer()
    for seq in order:
        _recv(layout, addresses, seq)
        assert _credit(layout, buffer, seq % layout.slots) == seq
    assert [_credit(layout, buffer, slot) for slot in range(layout.slots)] == [4, 5]


def test_credits_never_move_back() -> None:
    layout, buffer, addresses = _one_pe_recv_buffer()
    for seq in (7, 5):
        peer_copy.give_credit[(1,)](addresses, 0, seq, 1, layout.offsets["dispatch_credit"], EP=1, PUT=0, DOMAIN=1)
    assert _credit(layout, buffer, 1) == 7


def test_per_call_ints_are_never_specialized() -> None:
    """Compiled Triton makes an int argument equal to 1 a constant (and marks multiples of 16):
    `seq.to(...)` then fails to compile on the first call, and every new value recompiles."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    per_call = {"rank", "seq", "epoch", "slot", "first_token", "first_word", "timeout", "phase"}
    for kernel in peer_copy.KERNELS:
        declared = kernel.compiled  # interpreted in a process that set TRITON_INTERPRET=1
        if isinstance(declared, InterpretedFunction):
            unspecialized = set(declared.kwargs["do_not_specialize"])
        else:
            unspecialized = {p.name for p in declared.params if p.do_not_specialize}
        present = set(inspect.signature(kernel.fn).parameters) & per_call
        assert present, kernel.fn.__name__
        assert present <= unspecialized, f"{kernel.fn.__name__} specializes {sorted(present - unspecialized)}"


def test_a_cpu_transport_interprets_even_where_kernels_are_compiled() -> None:
    """`DeviceKernel` picks per launch: CPU tensors never reach a compiled kernel (which would need
    a GPU), CUDA tensors never reach the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from moeserve.kernels.targets import DeviceKernel

    compiled = JITFunction(peer_copy.give_credit_kernel.fn, do_not_specialize=peer_copy._PER_CALL)
    kernel = DeviceKernel(compiled)
    assert isinstance(kernel.for_device(torch.device("cpu")), InterpretedFunction)
    assert kernel.for_device(torch.device("cuda")) is kernel.compiled
    layout, buffer, addresses = _one_pe_recv_buffer()
    kernel[(1,)](addresses, 0, 3, 1, layout.offsets["dispatch_credit"], EP=1, PUT=0, DOMAIN=1)
    assert _credit(layout, buffer, 1) == 3


class _GpuMirror:
    """The error words as a GPU's low-latency step shows them to the host: only an earlier copy
    (`_ErrorMirror` on CUDA), here none yet."""

    def read(self, synced: bool) -> list[int] | None:
        return None


def test_a_timed_out_low_latency_step_is_caught_before_its_tokens() -> None:
    """On a GPU a low-latency wait that runs out hands out zero counts and the step goes on, no
    host sync to see the record: dispatch returns. `check_step`, which the runner calls before a
    step's tokens leave, reads the record itself and names the peer and the phase."""
    rank0, _ = two_pes(timeout_s=0.5)
    rank0._error_seen = _GpuMirror()
    sent = within(60, lambda: rank0.dispatch(*inputs(5), 8))  # rank 1 never sends: no rows from it
    assert int(sent.num_tokens_per_expert.sum()) < 5 * 2  # rank 0's own pairs at most
    with pytest.raises(PeerTimeout, match=r"rank 0: no word from rank 1 for 0.5 s in dispatch receive"):
        rank0.check_step()


def test_the_runner_produces_no_token_from_a_failed_step(make_checkpoint, monkeypatch) -> None:
    """The runner asks every dispatcher of the model after sampling, before any token leaves."""
    from host_sync_cases import BLOCK_SIZE, step

    from moeserve.dispatch import create_dispatcher
    from moeserve.models import load_model, model_config
    from moeserve.worker.kv_cache import allocate_kv_caches
    from moeserve.worker.runner import ModelRunner

    folder = make_checkpoint("qwen3_moe")
    dispatcher = create_dispatcher("local", ExpertPlacement.contiguous(model_config(folder).num_experts, 1, 0))
    model = load_model(folder, torch.float32, "cpu", dispatcher)
    runner = ModelRunner(
        model, allocate_kv_caches(model.cfg, 2, BLOCK_SIZE, torch.float32, "cpu"), BLOCK_SIZE, (), seed=0
    )
    prompts = {"a": [3, 7, 11]}
    assert set(runner.execute(step(prompts, None))) == {"a"}  # a healthy step samples

    def dead_peer() -> None:
        raise PeerTimeout("rank 0: no word from rank 1 for 0.5 s in dispatch receive")

    monkeypatch.setattr(dispatcher, "check_step", dead_peer)
    with pytest.raises(PeerTimeout, match="rank 1"):
        runner.execute(step(prompts, {"a": 5}))
