"""NVSHMEM's symmetric heap is sized from the dispatcher's layout before NVSHMEM starts, and a
heap that cannot hold it is refused by name: DeepSeek-V3's shape (H 7168, top-k 8, 256 experts
over EP 8, chunks of 128 tokens) with bf16 rows needs more than NVSHMEM's 1 GiB default, with
FP8 rows less."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import DispatchRows, ExpertPlacement
from moeserve.dispatch.nvshmem_layout import SymmetricLayout
from moeserve.dispatch.symmetric.nvshmem_heap_size import (
    DEFAULT_HEAP_BYTES,
    MIB,
    SYMMETRIC_SIZE_VAR,
    heap_size_to_export,
    parse_heap_size,
    required_heap_bytes,
)

GPU_FREE = 80 << 30  # an H100's memory, as good as all free at startup


def deepseek_v3_required(dispatch_fp8: bool) -> int:
    layout = SymmetricLayout.for_rows(
        ExpertPlacement.contiguous(256, 8, 3), DispatchRows(7168, 8, torch.bfloat16), 128, dispatch_fp8
    )
    return required_heap_bytes([layout.nbytes])


def test_deepseek_v3_bf16_needs_more_than_the_default_heap_and_exports_it() -> None:
    required = deepseek_v3_required(dispatch_fp8=False)
    assert 924 * MIB < required and required > DEFAULT_HEAP_BYTES
    assert heap_size_to_export(required, None, GPU_FREE) == required
    assert heap_size_to_export(required, "2g", GPU_FREE) is None  # the user's larger value stands


def test_deepseek_v3_fp8_fits_the_default_heap() -> None:
    required = deepseek_v3_required(dispatch_fp8=True)
    assert required < DEFAULT_HEAP_BYTES
    assert heap_size_to_export(required, None, GPU_FREE) is None


def test_too_small_a_heap_is_refused_naming_the_variable_and_both_sizes() -> None:
    required = deepseek_v3_required(dispatch_fp8=False)
    with pytest.raises(ValueError, match=rf"{required} bytes .*{SYMMETRIC_SIZE_VAR}=1g gives {1 << 30} bytes") as user:
        heap_size_to_export(required, "1g", GPU_FREE)
    assert f"raise {SYMMETRIC_SIZE_VAR} to at least {-(-required // MIB)}m" in str(user.value)
    with pytest.raises(
        ValueError, match=rf"{required} bytes .*only {512 * MIB} bytes .* are free.*{SYMMETRIC_SIZE_VAR}"
    ):
        heap_size_to_export(required, None, 512 * MIB)


def test_sizes_are_read_as_nvshmem_reads_them() -> None:
    assert [parse_heap_size(t) for t in ("20m", "3.1M", ".5m", "1073741824", "2G", "20kk")] == [
        20 << 20,
        3250586,
        1 << 19,
        1 << 30,
        2 << 30,
        20 << 10,
    ]
    with pytest.raises(ValueError, match=SYMMETRIC_SIZE_VAR):
        parse_heap_size("lots")


def test_every_buffer_is_rounded_up_on_top_of_the_reserve() -> None:
    one_byte, two_buffers = required_heap_bytes([1]), required_heap_bytes([1, 2 * MIB + 1])
    assert two_buffers - one_byte == 4 * MIB
