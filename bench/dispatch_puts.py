"""The `nvshmem` backend's put path on a GPU machine: every row, signal and credit an NVSHMEM put.

    python bench/dispatch_puts.py [--out F] [--world N] [--world-timeout S]

`nvlink_domain_size=0` (`moeserve.dispatch.nvshmem.ALL_PUTS`) leaves no peer to load/store, the
rank itself included, so the put variants (`peer_copy`'s `PUT_NVSHMEM`, linked with NVSHMEM's
device bitcode, their CUDA modules initialised for NVSHMEM) run on whatever GPUs the machine has:

1. world 1: one process puts to itself through NVSHMEM;
2. world N, on a machine with N > 1 GPUs (--world picks fewer; 1 skips it): N processes, a GPU
   each, with `NVSHMEM_DISABLE_P2P=1`, so NVSHMEM may not reach the other GPUs over NVLink or
   PCIe peer-to-peer and its puts take the remote transport (IBGDA or IBRC over the NIC) as
   between nodes. The machine's NICs (`/sys/class/infiniband`) are recorded beside the result:
   without one NVSHMEM has no path, and the record says why the world could not run.

Each world runs `dispatch_check`'s symmetric-memory cases (small: NVSHMEM's default heap holds
them) in both modes over PyTorch's symmetric memory with its NVSHMEM backend, and compares each
PE's rows, counts and combine output with `local` on all PEs' tokens, bit for bit. Each world
runs in child processes bounded by --world-timeout, so a hang costs that world only.

Writes $OUT/results/dispatch_puts.json under the GPU runbook, else bench/results/dispatch_puts.json.
Without CUDA: one line, exit 2. Exit 1: world 1 did not pass, or a world that ran was not
bit-equal (a world N that NVSHMEM could not start is recorded with its reason, not failed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # run as a script from anywhere, moeserve installed or not

from dispatch_check import case_layout, check_pe, symmetric_memory_cases  # noqa: E402

from moeserve.dispatch.nvshmem import ALL_PUTS, CHUNK_TOKENS  # noqa: E402

NO_P2P = {"NVSHMEM_DISABLE_P2P": "1"}  # between a node's GPUs: NVSHMEM's network path, not NVLink


def nics() -> list[str]:
    """The machine's RDMA devices, as the kernel lists them (empty: no NIC NVSHMEM could use)."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def pe_main(rank: int, world: int, folder: Path) -> int:
    """One PE: a process group over a file store, an NVSHMEM heap, every case's runs at ALL_PUTS."""
    from moeserve.dispatch.symmetric.nvshmem_heap import NvshmemHeap, nvshmem_heap_unavailable

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    result: dict = {"rank": rank, "ran": False}
    try:
        store = dist.FileStore(str(folder / "store"), world)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
        import torch.distributed._symmetric_memory as symm_mem

        reason = nvshmem_heap_unavailable(device)
        if reason is None and not symm_mem.is_nvshmem_available():
            reason = "this torch's symmetric memory has no NVSHMEM backend: the put variants need NVSHMEM's heap"
        if reason is not None:
            result["reason"] = reason
        else:
            runs = [(case, *mode) for case in symmetric_memory_cases() for mode in case.modes(world, CHUNK_TOKENS)]
            sizes = [case_layout(case, world, CHUNK_TOKENS, staged=True).nbytes for case, *_ in runs]
            heap = NvshmemHeap(None, device, sizes, nvlink_domain_size=ALL_PUTS)
            cases = [
                check_pe(case, world, rank, mode, bound, heap, device, CHUNK_TOKENS, ALL_PUTS)
                for case, mode, bound in runs
            ]
            torch.cuda.synchronize(device)
            result.update(ran=True, passed=all(c["passed"] for c in cases), cases=cases)
    except Exception as e:  # noqa: BLE001 - why it could not run is the result
        result.update(reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    (folder / f"pe{rank}.json").write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run_world(world: int, env: dict[str, str], timeout_s: float) -> dict:
    """`world` PE processes at once; their records merged: ran and passed only if every PE's did."""
    record: dict = {"world": world, "env": env}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        logs = [open(folder / f"pe{rank}.log", "w") for rank in range(world)]  # noqa: SIM115 - closed below
        procs = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--pe", str(rank), "--world", str(world), str(folder)],
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for rank, log in enumerate(logs)
        ]
        for proc in procs:
            try:
                proc.wait(max(1.0, timeout_s - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        pes = []
        for rank in range(world):
            path = folder / f"pe{rank}.json"
            if path.exists():
                pes.append(json.loads(path.read_text()))
            else:
                tail = (folder / f"pe{rank}.log").read_text()[-1500:]
                pes.append({"rank": rank, "ran": False, "reason": f"no record in {timeout_s:.0f} s: {tail}"})
    record["seconds"] = round(time.monotonic() - started, 1)
    record["ran"] = all(pe["ran"] for pe in pes)
    record["passed"] = record["ran"] and all(pe["passed"] for pe in pes)
    record["pes"] = pes
    return record


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "results" / "dispatch_puts.json"
    return ROOT / "bench" / "results" / "dispatch_puts.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="result JSON (default: see default_out)")
    parser.add_argument("--world", type=int, help="PEs of the multi-GPU run (default: every GPU; 1: none)")
    parser.add_argument("--world-timeout", type=float, default=120.0, help="seconds each world may take")
    parser.add_argument("--pe", type=int, help=argparse.SUPPRESS)
    parser.add_argument("folder", type=Path, nargs="?", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pe is not None:
        return pe_main(args.pe, args.world, args.folder)
    if not torch.cuda.is_available():
        print("bench/dispatch_puts.py needs a CUDA device (none here)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    world = min(args.world or gpus, gpus)
    record: dict = {
        "bench": "dispatch_puts",
        "device": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "nics": nics(),
        "nvshmem_env": {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")},
        "worlds": [run_world(1, {}, args.world_timeout)],
    }
    if world > 1:
        record["worlds"].append(run_world(world, NO_P2P, args.world_timeout))
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    for w in record["worlds"]:
        reasons = "; ".join(pe.get("reason", "")[:300] for pe in w["pes"] if not pe["ran"])
        how = "passed" if w["passed"] else "FAILED" if w["ran"] else f"not run: {reasons}"
        print(f"world {w['world']} {w['env'] or ''} every peer by NVSHMEM puts: {how} ({w['seconds']} s)")
    print(f"NICs: {record['nics'] or 'none'}\nwrote {out}", flush=True)
    first, *others = record["worlds"]
    return 0 if first["passed"] and all(w["passed"] or not w["ran"] for w in others) else 1


if __name__ == "__main__":
    sys.exit(main())
