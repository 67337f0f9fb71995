"""`bench/dispatch.py`, the one-command GPU proof of the device-initiated dispatch, checked on CPU.

The smoke run (tiny sizes, Triton's interpreter) walks every stage a GPU run does and must write
a complete record; the pieces it relies on (the comparison that decides "bit-equal", the phases
and traffic accounting, the goals' verdicts) are checked directly, each against a case it must
reject or a figure worked out by hand.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from moeserve.dispatch import DispatchLayout, DispatchOutput, ExpertPlacement
from moeserve.dispatch.base import DispatchHandle

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "dispatch.py"


def _bench():
    """bench/ is not a package: load bench/dispatch.py by path, once (it puts bench/ on sys.path,
    whence its two halves, `dispatch_check` and `dispatch_timing`, import)."""
    name = "dispatch_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


def _check():
    _bench()
    return importlib.import_module("dispatch_check")


def _timing():
    _bench()
    return importlib.import_module("dispatch_timing")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke run; a GPU runs the real one")
def test_smoke_run_walks_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "dispatch.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    plan = record["plan"]
    assert record["smoke"] and record["device"].startswith("cpu") and record["copy"]["copy_gbps"] > 0
    assert "loopback" in record["emulation"] and record["goals"]["pplx_nvlink_ep8_dispatch_us"] == 83.6

    checks = record["correctness"]
    assert checks["passed"] and all(c["passed"] and not c["problems"] for c in checks["cases"])
    assert {(c["mode"], c["dtype"], c["fp8"]) for c in checks["cases"]} >= {
        ("low_latency", "bfloat16", True),
        ("high_throughput", "bfloat16", True),
        ("high_throughput", "float32", False),
    }

    lat, bw, ov = record["latency"], record["bandwidth"], record["overlap"]
    assert lat["mode"] == "low_latency" and lat["chunks"] == 1
    assert lat["rows_moved"] == plan["pes"] * plan["latency_tokens"] * plan["top_k"]
    assert lat["dispatch_total_us"] == pytest.approx(lat["dispatch_send_us"] + lat["dispatch_receive_us"])
    assert lat["host_enqueue_us"] > 0 and lat["combine_total_us"] > 0
    assert "profile_per_pe" not in lat  # CUDA only
    fp8 = record["latency_fp8"]
    assert fp8["dispatch_fp8"] and not lat["dispatch_fp8"] and fp8["rows_moved"] == lat["rows_moved"]
    assert lat["dispatch_row_bytes"] == plan["hidden"] * 2 and fp8["dispatch_row_bytes"] == plan["hidden"] + 4
    assert bw["mode"] == "high_throughput" and bw["chunks"] == -(-plan["bandwidth_tokens"] // plan["chunk_tokens"])
    assert bw["rows_moved"] == plan["pes"] * plan["bandwidth_tokens"] * plan["top_k"]
    assert bw["dispatch_stream_fraction_of_copy"] > 0 and "host_enqueue_us" not in bw
    assert ov["comm_alone_us"] > 0 and ov["gemm_alone_us"] > 0
    assert ov["ratio"] == pytest.approx(ov["both_us"] / max(ov["comm_alone_us"], ov["gemm_alone_us"]))
    assert ov["gemm_programs"] == max(1, ov["sm_count"] - ov["comm_programs"])

    assert set(record["verdicts"]) == {"low_latency", "low_latency_fp8", "high_throughput", "overlap"}
    assert all(v["met"] is None for v in record["verdicts"].values())  # interpreter wall clock: no verdict
    assert not record["symmetric_memory"]["ran"] and "CUDA" in record["symmetric_memory"]["reason"]
    assert set(record["stage_seconds"]) >= {"correctness", "latency", "bandwidth", "overlap", "symmetric_memory"}
    assert f"wrote {out}" in proc.stdout and "cases bit-equal to local" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_it_asks_for_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main([]) == 2
    err = capsys.readouterr().err
    assert "--smoke" in err and len(err.strip().splitlines()) == 1


def test_a_stalled_run_saves_its_record_and_exits(tmp_path: Path) -> None:
    """A wait kernel that never returns must not cost the record: the watchdog saves it and exits 3."""
    out, codes, exited = tmp_path / "stalled.json", [], threading.Event()
    run = _bench().Run(out, {"bench": "dispatch"}, limit=60, stall=0.2, exit=lambda c: (codes.append(c), exited.set()))
    run.stage("correctness")
    assert exited.wait(10) and codes == [3]
    record = json.loads(out.read_text())
    assert "without progress" in record["error"] and "'correctness'" in record["error"]


# --- the comparison that decides "bit-equal" -------------------------------------------------


def _reference_and_output(check):
    """Four experts on 2 PEs (PE 0 holds 0 and 1), 3 tokens of PE 0 at top-2, and what a correct
    high-throughput dispatch hands PE 0."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 4, generator=g) for n in (2, 1, 3, 0)]
    ref = check.Reference(rows=rows, counts=[2, 1, 3, 0], out=torch.randn(5, 4, generator=g))
    received = DispatchOutput(
        hidden=torch.cat([rows[0], rows[1]]),
        num_tokens_per_expert=torch.tensor([2, 1]),
        layout=DispatchLayout.EXPERT_MAJOR,
        handle=DispatchHandle(num_tokens=3),
        num_tokens_per_expert_host=(2, 1),
    )
    return ref, received, ref.out[:3].clone(), ExpertPlacement.contiguous(4, 2, 0)


def test_compare_accepts_equal_results_and_names_each_difference() -> None:
    check = _check()
    ref, received, out, placement = _reference_and_output(check)
    assert check.compare_pe(received, out, ref, placement, 0, None, 2) == []

    swapped = torch.cat([received.hidden[1:2], received.hidden[0:1], received.hidden[2:]])
    problems = check.compare_pe(
        DispatchOutput(swapped, received.num_tokens_per_expert, received.layout, received.handle, (2, 1)),
        out, ref, placement, 0, None, 2,
    )  # fmt: skip
    assert problems == ["received rows differ at 2 rows, first [0, 1]"]

    wrong_out = out.clone()
    wrong_out[2, 3] += 1e-3
    assert check.compare_pe(received, wrong_out, ref, placement, 0, None, 2) == ["combine output differs from local's"]
    assert check.compare_pe(received, out, ref, placement, 1, None, 2) == ["combine output differs from local's"]

    no_host_read = DispatchOutput(received.hidden, received.num_tokens_per_expert, received.layout, received.handle)
    assert "host counts" in check.compare_pe(no_host_read, out, ref, placement, 0, None, 2)[0]
    # low-latency with a bound of 3: 2 PEs * 3 tokens * min(K=2, L=2) padded rows, not 3
    assert "low-latency output of 3 rows (want 12)" in check.compare_pe(received, out, ref, placement, 0, 3, 2)[0]

    miscounted = DispatchOutput(received.hidden, torch.tensor([1, 2]), received.layout, received.handle, (1, 2))
    assert check.compare_pe(miscounted, out, ref, placement, 0, None, 2) == ["counts (1, 2) != (2, 1)"]


def test_modes_follow_the_chunk_bound() -> None:
    check = _check()
    case = check.Case("c", 8, 2, 16, "uniform", "contiguous", (5, 9), torch.float32, 0)
    assert case.tokens(3) == (5, 9, 5)
    assert case.modes(2, 9) == (("low_latency", 9), ("high_throughput", None))
    assert case.modes(2, 8) == (("high_throughput", None),)
    assert [c.name for c in check.cases_for(8, smoke=False)][-1] == "rank-without-experts-E7"
    assert all(c.num_experts >= 8 or c.placement == "round_robin" for c in check.cases_for(8, smoke=False))


# --- timing: phases, starvation, traffic ------------------------------------------------------


def _segments(timing, per_pe_us: list[list[float]], starved: set[tuple[int, int]] = frozenset()):
    return [
        [timing.Segment(0.0, us * 1e-6, (pe, step) in starved) for step, us in enumerate(steps)]
        for pe, steps in enumerate(per_pe_us)
    ]


def test_phases_split_the_steps_as_the_generators_yield() -> None:
    timing = _timing()
    clock = timing.WallClock()
    segs = _segments(timing, [[1, 2, 3, 4], [5, 6, 7, 8]])  # HT dispatch of 2 chunks: notify, read+send, 2 receives
    phases = timing.phase_us(clock, segs, "dispatch", "high_throughput")
    rounded = {name: [round(us, 6) for us in per_pe] for name, per_pe in phases.items()}
    assert rounded == {"notify_and_first_send": [3, 11], "stream": [7, 15], "total": [10, 26]}
    low = timing.phase_us(clock, _segments(timing, [[1, 2]]), "combine", "low_latency")
    assert {name: [round(us, 6) for us in per_pe] for name, per_pe in low.items()} == {
        "send": [1],
        "receive": [2],
        "total": [3],
    }


def test_only_the_host_read_may_run_dry() -> None:
    timing = _timing()
    read = _segments(timing, [[1, 1, 1, 1]] * 2, starved={(0, 1), (1, 1)})
    assert timing.starved_steps(read, "dispatch", "high_throughput") == 0
    assert timing.starved_steps(read, "dispatch", "low_latency") == 2
    assert timing.starved_steps(read, "combine", "high_throughput") == 2


def test_timed_lockstep_times_every_step_of_every_pe() -> None:
    timing = _timing()
    order = []

    def pe(rank: int, steps: int):
        for step in range(steps):
            order.append((rank, step))
            yield
        order.append((rank, steps))
        return rank * 10

    results, segments, host_s = timing.timed_lockstep([pe(0, 2), pe(1, 1)], timing.WallClock())
    assert results == [0, 10] and [len(s) for s in segments] == [3, 2] and host_s > 0
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]  # one step of each PE per round, as run_lockstep


def test_traffic_counts_read_and_write_bytes_of_each_kernel() -> None:
    timing = _timing()
    figures = {"dispatch_total_us": 10.0, "combine_total_us": 5.0, "dispatch_stream_us": 4.0}
    moved = timing.traffic(figures, chunk_rows=[6, 2], tokens=3, pes=2, row_bytes=1000, out_row_bytes=1500)
    assert moved["rows_moved"] == 8
    assert moved["dispatch_gbps"] == pytest.approx(4 * 8 * 1000 / 20 / 1e3)  # send + receive, 2x each
    assert moved["combine_gbps"] == pytest.approx((3 * 8 + 6) * 1500 / 10 / 1e3)
    assert moved["dispatch_stream_gbps"] == pytest.approx(2 * 1000 * (2 + 8) / 8 / 1e3)  # sends 1.., receives all


def test_verdicts_hold_each_figure_to_its_goal() -> None:
    bench = _bench()
    record = {
        "smoke": False,
        "latency": {"dispatch_total_us": 80.0, "combine_total_us": 110.0},
        "bandwidth": {"dispatch_stream_fraction_of_copy": 0.85},
        "overlap": {"ratio": 1.05},
    }
    v = bench.verdicts(record)
    assert (v["low_latency"]["met"], v["high_throughput"]["met"], v["overlap"]["met"]) == (False, True, True)
    record["latency"]["combine_total_us"] = 100.0
    assert bench.verdicts(record)["low_latency"]["met"] is True
    assert bench.verdicts({"smoke": False, "latency": {"error": "boom"}}) == {}


def test_a_pe_on_its_own_through_every_put_matches_local() -> None:
    """`check_pe`, what each process of `bench/dispatch_puts.py` runs, on CPU: one PE of world 1
    on an emulated heap at `nvlink_domain_size=0`, every row put to itself, in both modes."""
    from moeserve.dispatch.nvshmem import ALL_PUTS
    from moeserve.dispatch.symmetric import EmulatedWorld

    check = _check()
    runs = [(case, *mode) for case in check.cases_for(2, smoke=True) for mode in case.modes(1, 8)]
    assert {mode for _, mode, _ in runs} == {check.LOW_LATENCY, check.HIGH_THROUGHPUT}
    for case, mode, bound in runs:
        heap = EmulatedWorld(1).heaps[0]
        record = check.check_pe(case, 1, 0, mode, bound, heap, torch.device("cpu"), 8, ALL_PUTS)
        assert record["passed"], (case.name, mode, record["problems"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_put_runbook_case_needs_cuda() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "dispatch_puts.py")], capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
