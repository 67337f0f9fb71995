"""Device-initiated dispatch/combine (`nvshmem` backend) on one GPU: correctness, then speed.

    python bench/dispatch.py                  # on a GPU: bench/results/dispatch.json (or $OUT/results/)
    python bench/dispatch.py --smoke --out F  # anywhere: tiny sizes, Triton's interpreter without CUDA
    python bench/dispatch.py --concurrent     # on a GPU: the PEs at once, bench/results/dispatch_concurrent.json

1. Environment: device, torch/triton versions, SM count, and a 1 GiB device-to-device copy's
   bandwidth (read + write bytes), which every bandwidth figure below is a fraction of.
2. Correctness (`dispatch_check.py`): emulated PEs (2, 4 and 8) in both modes, bf16 and fp32,
   FP8 rows or not, several routings: received rows, counts and combine output bit-equal to the `local`
   dispatcher on all PEs' tokens. Then (last, in a child process, so a hang or crash there
   costs nothing else) world 1 over PyTorch symmetric memory / NVSHMEM where it runs, or why not.
3. Only if every emulated case is bit-equal, at DeepSeek-V3's shape (hidden 7168, 256 experts,
   top-8, bf16) on 8 emulated PEs (`dispatch_timing.py` says how the device is timed):
   low-latency dispatch and combine at 128 tokens per PE (bf16 rows, and FP8 rows);
   high-throughput at 4096 tokens per PE as GB/s of kernel traffic and its fraction of the
   copy's; and overlap: the low-latency dispatch + combine (kernels on `num_comm_sms` programs)
   on one stream beside `fused_moe` (capped to the other SMs by `max_programs`) on another, as
   time(both) / max(time alone), and as time(both) / (time(comm) + time(GEMM)), the serial sum
   two-batch overlap would otherwise pay (1.0: no overlap at all; 0.5 at best for equal
   lengths). On CUDA also the high-throughput run with the comm kernels on every SM, and the
   low-latency run's device time per kernel.

--concurrent instead runs step 2's cases with every emulated PE on a host thread and a CUDA
stream of its own (`dispatch_check.run_concurrently`), its dispatchers' comm streams beside it,
several rounds on the same dispatchers: nothing but the kernels' signals and credits orders the
PEs, so a real wait, credit or slot reuse that is wrong shows as a difference or a hang. 8 PEs
of 20 comm programs fit beside each other on an H100's 132 SMs. It needs CUDA (exit 2 without,
--smoke or not: on CPU the PEs can only take turns).

Without CUDA and without --smoke: one line, exit status 2. Exit 1: a case was not bit-equal
(emulated, or over symmetric memory); 3: the run reached --time-limit, or --stall-limit without
progress (the JSON says in which stage). The JSON is written after every stage, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run as a script from anywhere, moeserve installed or not

from dispatch_check import (  # noqa: E402
    HIGH_THROUGHPUT,
    LOW_LATENCY,
    case_layout,
    cases_for,
    check_case,
    routing,
    run_concurrently,
    symmetric_memory_cases,
)
from dispatch_timing import Clock, CudaClock, WallClock, kernel_profile, rows_per_chunk, time_mode, traffic  # noqa: E402

from moeserve.dispatch import DispatchRows, ExpertPlacement, NvshmemDispatcher  # noqa: E402
from moeserve.dispatch.fp8 import packed_row_bytes  # noqa: E402
from moeserve.dispatch.symmetric import EmulatedWorld, run_lockstep  # noqa: E402
from moeserve.dispatch.symmetric.nvshmem_heap import nvshmem_heap_unavailable  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GOALS = {
    "low_latency": "dispatch and combine at 128 tokens per PE within pplx's NVLink EP8 figures",
    "pplx_nvlink_ep8_dispatch_us": 83.6,
    "pplx_nvlink_ep8_combine_us": 102.3,
    "high_throughput": "dispatch at 4096 tokens per PE: kernel traffic >= this fraction of copy bandwidth",
    "min_fraction_of_copy": 0.8,
    "overlap": "dispatch + combine on K SMs beside fused_moe on the rest: time(both) / max(time alone) <= this",
    "max_overlap_ratio": 1.1,
    "concurrent": "every PE on its own host thread and stream, repeated rounds: bit-equal to local",
}
CONCURRENT_ROUNDS = 3  # more sequence numbers than the ring's 2 slots: every slot is reused

EMULATION = (
    "N PEs emulated in one process on one device: each PE's symmetric buffer is an ordinary device "
    "tensor that its peers' kernels store into through its address, so no byte crosses NVLink. All "
    "PEs' kernels run one after another on one stream (each dispatcher without comm streams of its own) "
    "and share this device's SMs and HBM. A per-PE "
    "figure is the device time of the kernels (and small torch ops) one PE runs, summed over its "
    "steps and averaged over the PEs: a loopback through HBM, without NVLink's bandwidth and latency "
    "and without waiting for the slowest peer, and with the host's launch time left out (the "
    "low-latency host_enqueue_us gives it). Compare it with NVLink figures as a bound on the kernels' "
    "own cost, not as an equal."
)


@dataclass(frozen=True)
class Plan:
    """One run's sizes: the GPU run at DeepSeek-V3's shape, or the smoke run's tiny ones."""

    smoke: bool
    worlds: tuple[int, ...]  # emulated PE counts of the correctness check
    chunk_tokens: int  # tokens per PE per chunk, the low-latency bound (the backend's own default on GPUs)
    pes: int  # emulated PEs of the timings
    hidden: int
    num_experts: int
    top_k: int
    inter: int  # the experts' intermediate size, for the GEMM beside the overlap's dispatch
    latency_tokens: int  # per PE, low-latency mode
    bandwidth_tokens: int  # per PE, high-throughput mode
    dtype: torch.dtype
    warmup: int
    reps: int
    max_balance: int  # the overlap repeats the shorter side up to this many times to match the longer


FULL = Plan(False, (2, 4, 8), 128, 8, 7168, 256, 8, 2048, 128, 4096, torch.bfloat16, 3, 10, 16)
SMOKE = Plan(True, (2,), 8, 2, 64, 8, 2, 32, 8, 12, torch.bfloat16, 0, 1, 1)  # 2 chunks at 12 tokens


class Run:
    """The JSON record, written after every stage, and a watchdog: a kernel that never returns (a
    wait for a signal nobody sends) spins forever, so past `limit` seconds in all, or `stall`
    seconds without progress, the record is saved with the stage it stopped in and the process exits."""

    def __init__(
        self, path: Path, record: dict, limit: float, stall: float, exit: Callable[[int], object] = os._exit
    ) -> None:
        """exit: how the watchdog ends the process (os._exit: no waiting on a thread stuck in a kernel)."""
        self.path, self.record, self.stage_name, self._exit = path, record, "start", exit
        self.record["stage_seconds"] = {}  # where a run's time goes (kernel compiles included)
        self.started = self._since = self._progress = time.monotonic()
        self._limit, self._stall, self._done = limit, stall, threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._watch, daemon=True).start()

    def stage(self, name: str | None) -> None:
        """Start stage `name` (None: the last one ended)."""
        now = self._progress = time.monotonic()
        if self.stage_name != "start":
            self.record["stage_seconds"][self.stage_name] = round(now - self._since, 1)
        self.stage_name, self._since = name, now
        if name is not None:
            print(f"[dispatch] {name}", flush=True)

    def progress(self) -> None:
        self._progress = time.monotonic()

    def left(self) -> float:
        return self._limit - (time.monotonic() - self.started)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2) + "\n")
        os.replace(tmp, self.path)

    def finish(self) -> None:
        self.stage(None)
        self._done.set()
        self.save()

    def _watch(self) -> None:
        while not self._done.wait(min(2.0, self._stall / 4)):
            now = time.monotonic()
            if now - self.started > self._limit:
                why = f"the {self._limit:.0f} s time limit"
            elif now - self._progress > self._stall and self.stage_name != "symmetric_memory":  # that one has its own
                why = f"{self._stall:.0f} s without progress (a wait that never returns?)"
            else:
                continue
            self.record["error"] = f"stopped by {why} in stage {self.stage_name!r}"
            self.save()
            print(f"[dispatch] {self.record['error']}; wrote {self.path}", flush=True)
            self._exit(3)
            return


def environment(device: torch.device) -> dict:
    import triton

    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke, Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "sm_count": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def copy_bandwidth(device: torch.device, clock: Clock, reps: int) -> dict:
    """GB/s of a large device-to-device copy, read + write bytes, median of repeats."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 24
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(max(3, reps)):
        clock.settle()
        mark = clock.begin()
        dst.copy_(src)
        segment = clock.end(mark)
        clock.settle()
        times.append(clock.us(segment))
    return {"copy_gbps": 2 * nbytes / statistics.median(times) / 1e3, "copy_bytes": nbytes}


def correctness(plan: Plan, device: torch.device, progress: Callable[[], None]) -> dict:
    return _every_case(plan, device, progress, "")


def _every_case(plan: Plan, device: torch.device, progress: Callable[[], None], how: str, **options) -> dict:
    """Every case of the plan in every mode against `local`; `options` go to `check_case` (how
    the PEs are driven, how many rounds), `how` names that driving in the printed lines."""
    records = []
    for world in plan.worlds:
        for case in cases_for(world, plan.smoke):
            for mode, bound in case.modes(world, plan.chunk_tokens):
                try:
                    rec = check_case(
                        case,
                        world,
                        mode,
                        bound,
                        lambda w=world: EmulatedWorld(w, device).heaps,
                        device,
                        plan.chunk_tokens,
                        **options,
                    )
                except Exception as e:  # noqa: BLE001 - a kernel that fails to build is a failed case, recorded
                    rec = {"world": world, "case": case.name, "mode": mode, "passed": False, "problems": [repr(e)]}
                records.append(rec)
                progress()
                verdict = "bit-equal" if rec["passed"] else f"FAILED: {'; '.join(rec['problems'][:3])}"
                print(f"  {world} PEs{how}  {case.name:44s} {mode:15s} {verdict}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {"reference": "local dispatcher on all PEs' tokens", "passed": all(r["passed"] for r in records),
            "cases": records}  # fmt: skip


def build_pes(plan: Plan, device: torch.device, tokens: int, comm_sms: int | None, fp8: bool = False):
    """`plan.pes` emulated PEs at the plan's shape, each with `tokens` uniformly routed tokens."""
    world = EmulatedWorld(plan.pes, device)
    g = torch.Generator(device=device).manual_seed(0)
    dispatchers, inputs = [], []
    for rank in range(plan.pes):
        placement = ExpertPlacement.contiguous(plan.num_experts, plan.pes, rank)
        dispatchers.append(
            NvshmemDispatcher(
                placement,
                DispatchRows(plan.hidden, plan.top_k, plan.dtype),
                device=device,
                heap=world.heaps[rank],
                chunk_tokens=plan.chunk_tokens,
                num_comm_sms=comm_sms,
                dispatch_fp8=fp8,
                comm_stream=False,  # one stream for all PEs, which the clock's events time
            )
        )
        hidden = torch.randn(tokens, plan.hidden, generator=g, device=device).to(plan.dtype)
        ids = routing("uniform", tokens, plan.num_experts, plan.top_k, g)
        inputs.append((hidden, ids, torch.rand(tokens, plan.top_k, generator=g, device=device)))
    return dispatchers, inputs


def measure_mode(
    plan: Plan, device, clock: Clock, comm_sms: int | None, copy_gbps: float, mode: str, fp8: bool = False
) -> dict:
    """One mode's timings on `plan.pes` emulated PEs (low-latency at `latency_tokens` per PE, with
    a profile of where the device time goes; high-throughput at `bandwidth_tokens`)."""
    tokens = plan.latency_tokens if mode == LOW_LATENCY else plan.bandwidth_tokens
    dispatchers, inputs = build_pes(plan, device, tokens, comm_sms, fp8)
    bound = tokens if mode == LOW_LATENCY else None
    figures, sent, retried = time_mode(dispatchers, inputs, mode, bound, clock, plan.warmup, plan.reps)
    chunk_rows = rows_per_chunk(sent)
    out_row_bytes = plan.hidden * plan.dtype.itemsize
    row_bytes = packed_row_bytes(plan.hidden) if fp8 else out_row_bytes
    moved = traffic(figures, chunk_rows, tokens, plan.pes, row_bytes, out_row_bytes)
    fractions = {k.replace("_gbps", "_fraction_of_copy"): v / copy_gbps for k, v in moved.items() if k.endswith("gbps")}
    profile = {}
    if mode == LOW_LATENCY and device.type == "cuda":  # on CPU the profiler's start alone takes seconds

        def once() -> None:
            sent = run_lockstep([d.dispatch_steps(*i, bound) for d, i in zip(dispatchers, inputs)])
            run_lockstep([d.combine_steps(o.hidden, o.handle) for d, o in zip(dispatchers, sent)])

        try:
            profile["profile_per_pe"] = kernel_profile(once, device, plan.pes)
        except Exception as e:  # noqa: BLE001 - the profile is an extra; the timings stand without it
            profile["profile_per_pe"] = [{"error": f"{type(e).__name__}: {e}"}]
    return {
        "mode": mode,
        "pes": plan.pes,
        "tokens_per_pe": tokens,
        "hidden": plan.hidden,
        "num_experts": plan.num_experts,
        "top_k": plan.top_k,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "dispatch_fp8": fp8,
        "dispatch_row_bytes": row_bytes,
        "chunk_tokens": plan.chunk_tokens,
        "chunks": len(chunk_rows),
        "comm_programs": dispatchers[0].num_programs,
        "reps": plan.reps,
        "repeats_measured_again": retried,
        **figures,
        **moved,
        **fractions,
        **profile,
    }


def measure_overlap(plan: Plan, device: torch.device, clock: Clock, comm_sms: int | None) -> dict:
    """time(both) / max(time alone): low-latency dispatch + combine of every PE on one stream,
    `fused_moe` over what one PE's experts receive on another, capped to the SMs the comm leaves."""
    from moeserve.kernels.fused_moe import fused_moe
    from moeserve.kernels.launch_config import block_m_for, default_max_programs
    from moeserve.kernels.moe_align import moe_align_block_size

    dispatchers, inputs = build_pes(plan, device, plan.latency_tokens, comm_sms)
    comm_programs, sms = dispatchers[0].num_programs, default_max_programs(device)
    gemm_programs = max(1, sms - comm_programs)
    local, rows = plan.num_experts // plan.pes, plan.latency_tokens * plan.top_k  # one PE's share of all pairs
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, plan.hidden, generator=g, device=device).to(plan.dtype)
    w13 = (torch.randn(local, 2 * plan.inter, plan.hidden, generator=g, device=device) * plan.hidden**-0.5).to(
        plan.dtype
    )
    w2 = (torch.randn(local, plan.hidden, plan.inter, generator=g, device=device) * plan.inter**-0.5).to(plan.dtype)
    ids = torch.randint(0, local, (rows, 1), generator=g, device=device, dtype=torch.int32)
    aligned = moe_align_block_size(ids, local, block_m_for(rows, 1, local))

    def comm(rounds: int):
        def run() -> None:
            for _ in range(rounds):
                sent = run_lockstep([d.dispatch_steps(*i, plan.latency_tokens) for d, i in zip(dispatchers, inputs)])
                run_lockstep([d.combine_steps(o.hidden, o.handle) for d, o in zip(dispatchers, sent)])

        return run

    def gemm(calls: int, programs: int | None):
        return lambda: [fused_moe(x, w13, w2, aligned, 1, max_programs=programs) for _ in range(calls)]

    retried = 0

    def timed(parts) -> float:
        nonlocal retried
        while True:
            clock.settle()
            segment = clock.concurrent(parts)
            clock.settle()
            if not segment.starved or retried >= 4 * plan.reps:
                return clock.us(segment)
            retried += 1
            clock.grow()

    rounds = calls = 1
    host_s = 0.0  # the host's time to queue one round of the comm, which the clock's sleep must cover
    for _ in range(plan.warmup):
        gemm(1, gemm_programs)()
        gemm(1, None)()
        clock.settle()
        started = time.perf_counter()
        comm(1)()
        host_s = time.perf_counter() - started
    clock.ensure_sleep(2 * host_s)
    if plan.max_balance > 1:  # similar lengths, or the ratio says little about interference
        comm_us, gemm_us = timed([comm(1)]), timed([gemm(1, gemm_programs)])
        if comm_us < gemm_us:
            rounds = min(plan.max_balance, max(1, round(gemm_us / comm_us)))
        else:
            calls = min(plan.max_balance, max(1, round(comm_us / gemm_us)))
        clock.ensure_sleep(2 * rounds * host_s)
    samples: dict[str, list[float]] = {"comm_alone_us": [], "gemm_alone_us": [], "both_us": [], "gemm_all_sms_us": []}
    for _ in range(plan.reps):  # interleaved, so drifts in clocks and temperature hit all alike
        samples["comm_alone_us"].append(timed([comm(rounds)]))
        samples["gemm_alone_us"].append(timed([gemm(calls, gemm_programs)]))
        samples["both_us"].append(timed([comm(rounds), gemm(calls, gemm_programs)]))
        samples["gemm_all_sms_us"].append(timed([gemm(calls, None)]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    serial = med["comm_alone_us"] + med["gemm_alone_us"]
    return {
        "comm": f"low-latency dispatch + combine of {plan.pes} emulated PEs at {plan.latency_tokens} tokens each, "
        f"{rounds} time(s), kernels on {comm_programs} programs",
        "gemm": f"fused_moe over {rows} rows, {local} experts of hidden {plan.hidden} and intermediate {plan.inter}, "
        f"{calls} call(s), max_programs={gemm_programs}",
        "sm_count": sms,
        "comm_programs": comm_programs,
        "gemm_programs": gemm_programs,
        "comm_rounds": rounds,
        "gemm_calls": calls,
        **med,
        "ratio": med["both_us"] / max(med["comm_alone_us"], med["gemm_alone_us"]),
        "serial_us": serial,
        "ratio_to_serial": med["both_us"] / serial,
        "repeats_measured_again": retried,
    }


def concurrent(plan: Plan, device: torch.device, progress: Callable[[], None]) -> dict:
    """Step 2's cases with the PEs at once (see --concurrent in the module docstring)."""
    drive = {"drive": lambda steps: run_concurrently(steps, device), "rounds": CONCURRENT_ROUNDS}
    return {"rounds": CONCURRENT_ROUNDS, **_every_case(plan, device, progress, " at once", **drive)}


def symmetric_memory(device: torch.device, seconds: float) -> dict:
    """World 1 over PyTorch symmetric memory, in a child process bounded by `seconds`."""
    if device.type != "cuda":
        return {"ran": False, "reason": nvshmem_heap_unavailable(device)}
    if seconds < 30:
        return {"ran": False, "reason": f"only {seconds:.0f} s of the time limit left"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "symmetric.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--symmetric-child", str(path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            return {"ran": False, "reason": f"the child process did not finish in {seconds:.0f} s"}
        if not path.exists():
            return {"ran": False, "reason": f"the child process exited {proc.returncode}: {proc.stderr[-1500:]}"}
        return json.loads(path.read_text())


def symmetric_child(path: Path) -> int:
    """The child: a one-rank process group, an `NvshmemHeap`, the world-1 cases against `local`."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    result: dict = {"ran": False}
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        reason = nvshmem_heap_unavailable(device)
        if reason is not None:
            result["reason"] = reason
        else:
            import torch.distributed._symmetric_memory as symm_mem

            from moeserve.dispatch.symmetric.nvshmem_heap import NvshmemHeap

            chunk = FULL.chunk_tokens
            runs = [(case, *mode) for case in symmetric_memory_cases() for mode in case.modes(1, chunk)]
            # every run builds a dispatcher, and so a buffer, on the one heap: sized for all of them
            heap = NvshmemHeap(None, device, [case_layout(case, 1, chunk).nbytes for case, *_ in runs])
            result["nvshmem_available"] = bool(symm_mem.is_nvshmem_available())
            cases = [check_case(case, 1, mode, bound, lambda: [heap], device, chunk) for case, mode, bound in runs]
            result.update(ran=True, passed=all(c["passed"] for c in cases), cases=cases)
    except Exception as e:  # noqa: BLE001 - why it could not run is the result
        result.update(reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    path.write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def verdicts(record: dict) -> dict:
    """Each goal against its figure; `met` is None in a smoke run (wall clock of the interpreter)."""
    out, smoke = {}, record["smoke"]
    bw, ov = record.get("bandwidth", {}), record.get("overlap", {})
    for name in ("latency", "latency_fp8"):  # bf16 rows, and FP8 rows (combine in bf16 either way)
        lat = record.get(name, {})
        if "dispatch_total_us" in lat:
            d, c = lat["dispatch_total_us"], lat["combine_total_us"]
            met = d <= GOALS["pplx_nvlink_ep8_dispatch_us"] and c <= GOALS["pplx_nvlink_ep8_combine_us"]
            out[name.replace("latency", "low_latency")] = {"dispatch_us": d, "combine_us": c, "met": met}
    if "dispatch_stream_fraction_of_copy" in bw:
        f = bw["dispatch_stream_fraction_of_copy"]
        out["high_throughput"] = {"fraction_of_copy": f, "met": f >= GOALS["min_fraction_of_copy"]}
    if "ratio" in ov:
        out["overlap"] = {"ratio": ov["ratio"], "met": ov["ratio"] <= GOALS["max_overlap_ratio"]}
    for v in out.values():
        v["met"] = None if smoke else v["met"]
    return out


def summary(record: dict) -> list[str]:
    env, checks = record["environment"], record.get("correctness", {})
    sym = record.get("symmetric_memory", {})
    cases = checks.get("cases", [])
    passed, worlds = sum(c["passed"] for c in cases), record["plan"]["worlds"]
    lines = [
        f"device {env['device']} ({env['sm_count']} SMs), copy {record.get('copy', {}).get('copy_gbps', 0):.0f} GB/s",
        f"correctness: {passed}/{len(cases)} cases bit-equal to local (emulated PEs {worlds})",
        "symmetric memory, world 1: "
        + (("passed" if sym.get("passed") else "FAILED") if sym.get("ran") else f"not run: {sym.get('reason')}"),
    ]
    v = record.get("verdicts", {})
    for name, rows in (("low_latency", "bf16"), ("low_latency_fp8", "FP8")):
        if name in v:
            ll = v[name]
            tokens = record["plan"]["latency_tokens"]
            lines.append(
                f"low-latency {tokens} tok/PE, {rows} rows: dispatch {ll['dispatch_us']:.1f} us (pplx 83.6), "
                f"combine {ll['combine_us']:.1f} us (pplx 102.3), met: {ll['met']}  [emulated loopback]"
            )
    if "high_throughput" in v:
        ht = v["high_throughput"]
        lines.append(
            f"high-throughput: dispatch stream at {ht['fraction_of_copy']:.0%} of copy (goal 80%), met: {ht['met']}"
        )
    if "dispatch_stream_fraction_of_copy" in record.get("bandwidth_all_sms", {}):
        every = record["bandwidth_all_sms"]
        lines.append(
            f"  the same on all {every['comm_programs']} SMs: {every['dispatch_stream_fraction_of_copy']:.0%} of copy"
        )
    if "overlap" in v:
        lines.append(
            f"overlap: {v['overlap']['ratio']:.2f}x the longer alone (goal <= 1.1x), met: {v['overlap']['met']}; "
            f"{record['overlap']['ratio_to_serial']:.2f}x the serial sum"
        )
    for stage in ("latency", "latency_fp8", "bandwidth", "overlap", "bandwidth_all_sms"):
        if "error" in record.get(stage, {}):
            lines.append(f"{stage}: {record[stage]['error']}")
    return lines


def default_out(smoke: bool, concurrent: bool = False) -> Path:
    """$OUT/results/ when the GPU runbook sets OUT, else bench/results/ (smoke: the temp dir, never the repo)."""
    name = "dispatch_concurrent.json" if concurrent else "dispatch_smoke.json" if smoke else "dispatch.json"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "results" / name
    return Path(tempfile.gettempdir()) / name if smoke else RESULTS / name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on CPU under Triton's interpreter")
    parser.add_argument("--out", type=Path, help="result JSON (default: see default_out)")
    parser.add_argument("--reps", type=int, help="timed repeats (default: 10, smoke 1)")
    parser.add_argument("--comm-sms", type=int, help="programs of each communication kernel (default: the backend's)")
    parser.add_argument(
        "--concurrent", action="store_true", help="only the correctness cases, every PE on its own thread and stream"
    )
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds before the run stops and saves")
    parser.add_argument("--stall-limit", type=float, default=180.0, help="seconds without progress before it stops")
    parser.add_argument("--symmetric-child", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.symmetric_child:
        return symmetric_child(args.symmetric_child)
    cuda = torch.cuda.is_available()
    if not cuda and args.concurrent:
        print("bench/dispatch.py --concurrent runs each PE on a CUDA stream: no CUDA device here", file=sys.stderr)
        return 2
    if not cuda and not args.smoke:
        print("bench/dispatch.py needs a CUDA device (none here); --smoke runs the CPU dry run", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (fused_moe's kernels)
    plan = SMOKE if args.smoke else FULL
    plan = replace(plan, reps=args.reps) if args.reps else plan
    device = torch.device("cuda" if cuda else "cpu")
    run = Run(
        args.out or default_out(args.smoke, args.concurrent),
        {"bench": "dispatch", "smoke": plan.smoke, "goals": GOALS},
        args.time_limit,
        args.stall_limit,
    )

    run.stage("environment")
    clock = CudaClock() if cuda else WallClock()
    env = environment(device)
    run.record.update(device=env["device"], environment=env, clock=clock.name, emulation=EMULATION)
    run.record["plan"] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(plan).items()}
    run.record["copy"] = copy_bandwidth(device, clock, plan.reps)
    run.save()
    if args.concurrent:
        return concurrent_run(run, plan, device)

    run.stage("correctness")
    run.record["correctness"] = correctness(plan, device, run.progress)
    run.save()
    correct = run.record["correctness"]["passed"]

    copy_gbps = run.record["copy"]["copy_gbps"]
    stages = {
        "latency": lambda: measure_mode(plan, device, clock, args.comm_sms, copy_gbps, LOW_LATENCY),
        "latency_fp8": lambda: measure_mode(plan, device, clock, args.comm_sms, copy_gbps, LOW_LATENCY, fp8=True),
        "bandwidth": lambda: measure_mode(plan, device, clock, args.comm_sms, copy_gbps, HIGH_THROUGHPUT),
        "overlap": lambda: measure_overlap(plan, device, clock, args.comm_sms),
    }
    if cuda:  # how much of the gap to the copy is the comm kernels' few SMs, how much the protocol
        stages["bandwidth_all_sms"] = lambda: measure_mode(
            plan, device, clock, env["sm_count"], copy_gbps, HIGH_THROUGHPUT
        )
    for name, stage in stages.items():
        run.stage(name)
        if not correct:
            run.record[name] = {"skipped": "the emulated PEs were not bit-equal to local"}
            continue
        try:
            run.record[name] = stage()
        except Exception as e:  # noqa: BLE001 - one stage failing must not lose the others
            run.record[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        run.record["verdicts"] = verdicts(run.record)
        run.save()
        if cuda:
            torch.cuda.empty_cache()

    run.stage("symmetric_memory")
    run.record["symmetric_memory"] = symmetric_memory(device, run.left() - 15)
    run.finish()
    print("\n".join(summary(run.record)) + f"\nwrote {run.path}", flush=True)
    symmetric = run.record["symmetric_memory"]
    return 0 if correct and (symmetric.get("passed") or not symmetric.get("ran")) else 1


def concurrent_run(run: Run, plan: Plan, device: torch.device) -> int:
    """The --concurrent run after the environment: its one stage; exit 1 unless every case is bit-equal."""
    run.stage("concurrent")
    run.record["concurrent"] = concurrent(plan, device, run.progress)
    run.finish()
    cases = run.record["concurrent"]["cases"]
    passed = sum(c["passed"] for c in cases)
    print(f"PEs at once, {CONCURRENT_ROUNDS} rounds each: {passed}/{len(cases)} cases bit-equal to local", flush=True)
    print(f"wrote {run.path}", flush=True)
    return 0 if run.record["concurrent"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
