"""The machine a GPU run happened on, and its two ceilings, which every ratio in the results divides by.

    python bench/gpu/gpu_env.py [--out F] [--reps 10]

Software: Python, torch (and its CUDA), triton, NVSHMEM (the wheel torch's symmetric memory loads,
and whether torch finds it), the carried wheels' versions, the repository's commit. Device: name,
compute capability, SM count, memory, L2, driver. Ceilings, measured now on this device (CUDA
events, median of --reps after 3 warm-ups, random data): a 1 GiB device-to-device copy in GB/s
counting bytes read and written, and an 8192^3 bf16 matrix product in TFLOP/s.

Writes bench/results/env.json (or --out). Without CUDA it records the software alone and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
WHEELS = ROOT / "bench" / "gpu" / "wheels.txt"
GEMM_N = 8192
COPY_BYTES = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the GPU runbook's dry run calls this with its own command line, on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "env.json")
    parser.add_argument("--reps", type=int, default=10)
    return parser.parse_args(argv)


def pinned_names(path: Path = WHEELS) -> list[str]:
    """Distribution names wheels.txt pins, in its order."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line.split("==", 1)[0] for line in lines if line]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(argv: list[str]) -> str | None:
    """First line of a command's output, or None where it is missing or fails."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def software() -> dict:
    """Versions of everything a result depends on; needs no device."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nvshmem = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("nvidia-nvshmem", "nvshmem4py"))
    }
    try:
        import torch.distributed._symmetric_memory as symm_mem

        nvshmem_in_torch = bool(symm_mem.is_nvshmem_available())
    except (ImportError, AttributeError, RuntimeError):
        nvshmem_in_torch = False
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "nvshmem_packages": nvshmem,
        "torch_finds_nvshmem": nvshmem_in_torch,
        "carried_wheels": {name: _version(name) for name in pinned_names()},
        "commit": _command(["git", "rev-parse", "HEAD"]),
    }


def device() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20,
        "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "visible_devices": torch.cuda.device_count(),
    }


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings(reps: int) -> dict:
    """What this device does now: the copy and GEMM rates every fraction in the results is of."""
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), reps)
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    gemm_ms = _median_ms(lambda: a @ b, reps)
    return {
        "copy_gbps": 2 * COPY_BYTES / copy_ms / 1e6,
        "copy_bytes": COPY_BYTES,
        "gemm_bf16_tflops": 2 * GEMM_N**3 / gemm_ms / 1e9,
        "gemm_shape": [GEMM_N] * 3,
        "reps": reps,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record: dict = {"software": software(), "cuda": torch.cuda.is_available()}
    if record["cuda"]:
        record["device"] = device()
        record["ceilings"] = ceilings(args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    if not record["cuda"]:
        print("bench/gpu/gpu_env.py: no CUDA device; software recorded only", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
