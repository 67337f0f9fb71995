"""The `nvshmem` backend's refusals, and its steps: one emulated PE, so no other process is needed."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import DispatchRows, ExpertPlacement, create_dispatcher
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.symmetric import EmulatedWorld

ROWS = DispatchRows(hidden_size=8, top_k=2, dtype=torch.float32)  # what `inputs` makes by default


def one_pe(rows: DispatchRows = ROWS, **options) -> NvshmemDispatcher:
    return NvshmemDispatcher(ExpertPlacement.contiguous(4), rows, heap=EmulatedWorld(1).heaps[0], **options)


def inputs(tokens: int, hidden: int = 8, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    return torch.randn(tokens, hidden, generator=g).to(dtype), ids, torch.rand(tokens, 2, generator=g)


def test_steps_yield_between_send_and_wait() -> None:
    """Low latency: one yield in dispatch (after the send) and one in combine; the chunked mode
    yields after the notify and after each chunk's send."""
    dispatcher = one_pe(chunk_tokens=4)
    x, ids, w = inputs(3)
    steps = dispatcher.dispatch_steps(x, ids, w, 3)
    assert next(steps) is None
    with pytest.raises(StopIteration) as done:
        next(steps)
    received = done.value.value
    assert list(dispatcher.combine_steps(received.hidden, received.handle)) == [None]
    x, ids, w = inputs(10)
    assert len(list(dispatcher.dispatch_steps(x, ids, w, None))) == 1 + 3  # notify, then ceil(10 / 4) chunks


def test_bad_calls_are_refused() -> None:
    dispatcher = one_pe()
    x, ids, w = inputs(5)
    with pytest.raises(ValueError, match="exceed this step's max_tokens_per_rank=4"):
        dispatcher.dispatch(x, ids, w, 4)
    received = dispatcher.dispatch(x, ids, w, 5)
    with pytest.raises(ValueError, match="combine got 3 rows"):
        dispatcher.combine(received.hidden[:3], received.handle)
    with pytest.raises(ValueError, match="float64 rows for a torch.float32 dispatch"):
        dispatcher.combine(received.hidden.double(), received.handle)
    with pytest.raises(ValueError, match="brings hidden size 16, top-k 2, torch.float32"):
        dispatcher.dispatch(*inputs(5, hidden=16), 5)
    with pytest.raises(ValueError, match="brings hidden size 8, top-k 2, torch.float16"):
        dispatcher.dispatch(*inputs(5, dtype=torch.float16), 5)
    with pytest.raises(ValueError, match="the kernels move 4-byte words"):  # refused when built, before any allocation
        one_pe(DispatchRows(3, 2, torch.float16))
    with pytest.raises(ValueError, match="pass the model's rows"):
        create_dispatcher("nvshmem", ExpertPlacement.contiguous(4))


def test_heap_must_match_the_placement() -> None:
    with pytest.raises(ValueError, match="heap is PE 0 of 2"):
        NvshmemDispatcher(ExpertPlacement.contiguous(4, ep_size=2, rank=1), ROWS, heap=EmulatedWorld(2).heaps[0])


def test_comm_sms_must_leave_the_gemms_an_sm() -> None:
    from moeserve.kernels.launch_config import compute_sms

    assert compute_sms(132, 20) == 112
    assert compute_sms(132, 131) == 1
    for comm in (0, 132, 200):
        with pytest.raises(ValueError, match=f"num_comm_sms={comm} must be at least 1 and leave"):
            compute_sms(132, comm)
    with pytest.raises(ValueError, match="num_comm_sms must be at least 1"):
        one_pe(num_comm_sms=0)


def test_cuda_needs_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_dispatcher("nvshmem", ExpertPlacement.contiguous(4), device="cuda", rows=ROWS)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_micro_batches_on_the_comm_streams_match_local(device: str) -> None:
    """Two interleaved micro-batches, each with compute reading its received rows between its
    dispatch and combine: the events must order the comm streams against that compute (on CUDA
    for real, where the comm SMs are also reserved from the GEMMs' grid)."""
    from moeserve.dispatch import LocalDispatcher
    from moeserve.kernels.launch_config import default_max_programs
    from moeserve.worker.two_batch import interleave

    dispatcher = NvshmemDispatcher(
        ExpertPlacement.contiguous(4), ROWS, device=device, heap=EmulatedWorld(1, device).heaps[0], num_comm_sms=8
    )
    assert len(dispatcher.comm_streams) == 2
    if device == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        assert default_max_programs(torch.device(device)) <= sms - 8

    def doubled_by_the_experts(x, ids, w):
        received = yield from dispatcher.dispatch_steps(x, ids, w, 6)
        return (yield from dispatcher.combine_steps(received.hidden * 2, received.handle))

    batches = [[t.to(device) for t in inputs(n)] for n in (6, 5)]
    local = LocalDispatcher(ExpertPlacement.contiguous(4))
    for _ in range(3):  # more dispatches than ring slots: the slots are reused
        got = interleave([doubled_by_the_experts(*batch) for batch in batches])
        for (x, ids, w), out in zip(batches, got):
            sent = local.dispatch(x, ids, w)
            assert torch.equal(out, local.combine(sent.hidden.repeat_interleave(2, 0) * 2, sent.handle))
