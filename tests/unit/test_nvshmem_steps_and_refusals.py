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


def test_cuda_needs_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_dispatcher("nvshmem", ExpertPlacement.contiguous(4), device="cuda", rows=ROWS)
