"""The `nvshmem` backend's symmetric buffer layout: regions apart and aligned, sizes as documented."""

from __future__ import annotations

import pytest

import moeserve.dispatch.nvshmem_layout as layout_module
from moeserve.dispatch.nvshmem_layout import ALIGN, SymmetricLayout


def test_regions_are_aligned_and_do_not_overlap() -> None:
    layout = SymmetricLayout(ep=4, local_experts=3, top_k=2, chunk_tokens=5, row_bytes=36, out_row_bytes=68)
    spans = sorted((layout.offsets[name], layout.offsets[name] + size) for name, size in layout.region_sizes.items())
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.nbytes
    assert layout.region_sizes["dispatch_rows"] == 2 * 3 * 4 * 5 * 36  # [S, L, EP, C] rows
    assert layout.region_sizes["combine_rows"] == 2 * 5 * 2 * 68  # [S, C * K] rows


def test_docstring_figures_come_from_the_layout() -> None:
    assert layout_module.deepseek_v3_line() in " ".join(layout_module.__doc__.split())


@pytest.mark.parametrize("field,value", [("ep", 0), ("top_k", -1), ("row_bytes", 6), ("out_row_bytes", 2)])
def test_bad_sizes_are_refused(field: str, value: int) -> None:
    sizes = dict(ep=2, local_experts=2, top_k=2, chunk_tokens=4, row_bytes=16, out_row_bytes=16)
    with pytest.raises(ValueError, match=field if field in ("ep", "top_k") else "4-byte words"):
        SymmetricLayout(**{**sizes, field: value})
