"""The `shm` symmetric heap across spawned rank processes, driven by Triton kernels under the interpreter."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import symmetric_shm_cases as cases
import torch
from ranks import run_ranks

from moeserve.dispatch.symmetric import shm


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    return run_ranks(4, cases.exchange, timeout=60)


def exchanges(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every heap exchange any rank ran: four PEs on the whole group, two on the pair."""
    found = [r["world"] for r in reports] + [r["pair"] for r in reports if "pair" in r]
    assert sorted((e["world_size"], e["rank"]) for e in found) == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    return found


def test_every_pe_receives_every_peers_row(reports: list[dict[str, Any]]) -> None:
    for e in exchanges(reports):
        for base, copy in e["copies"].items():
            expected = cases.expected_bytes(e["world_size"], base)
            assert torch.equal(copy, expected), f"PE {e['rank']} of {e['world_size']}, buffer {base}"


def test_buffers_and_heaps_do_not_alias(reports: list[dict[str, Any]]) -> None:
    for e in exchanges(reports):
        assert e["sessions"][0] != e["sessions"][1], "two heaps on one group must not share file names"
        spans = sorted(e["spans"])
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "no two mappings may overlap"
    for key in ("world", "pair"):
        assert len({r[key]["sessions"] for r in reports if key in r}) == 1, "a heap's PEs share rank 0's session"


def test_own_entry_is_local(reports: list[dict[str, Any]]) -> None:
    for e in exchanges(reports):
        assert all(e["own_address"])


def test_files_are_unlinked_once_mapped(reports: list[dict[str, Any]]) -> None:
    for e in exchanges(reports):
        assert e["leftover"] == []


def test_empty_allocation_is_refused(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        assert r["zero_error"] and "at least one byte" in r["zero_error"]


def test_every_rank_refuses_a_group_spanning_hosts(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        assert r["host_error"] and "rank 1 on 'elsewhere'" in r["host_error"]


def test_falls_back_to_temp_dir_without_shared_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path / "absent"))
    assert shm.shared_memory_dir() == tempfile.gettempdir()
