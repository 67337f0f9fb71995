"""`int64_tensor`: the same tensor `torch.tensor(list, dtype=int64)` gives, from any iterable."""

from __future__ import annotations

import gc

import pytest
import torch

from moeserve.ops.host_ints import int64_tensor


@pytest.mark.parametrize("values", [[], [0], [3, -1, 2**62], list(range(1000))])
def test_equals_torch_tensor(values: list[int]) -> None:
    made = int64_tensor(iter(values))
    assert made.dtype == torch.int64 and made.device.type == "cpu" and made.is_contiguous()
    assert torch.equal(made, torch.tensor(values, dtype=torch.int64))


def test_the_tensor_outlives_its_iterable_and_is_writable() -> None:
    made = int64_tensor(x * 2 for x in range(5))
    gc.collect()
    made += 1
    assert made.tolist() == [1, 3, 5, 7, 9]


def test_what_int64_cannot_hold_is_refused() -> None:
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
    with pytest.raises(TypeError):
        int64_tensor([1.5])
