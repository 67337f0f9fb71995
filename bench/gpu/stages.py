"""The GPU runbook's stages: what each one runs, what it proves, and how long it may take.

Paths are relative to the repository root. A stage's commands all run even when one fails; the
stage passes when every command exits 0. Scripts take `--out FILE` (added by the runbook) and
exit 2 when there is no CUDA device; each exposes `parse_args(argv)` so that the dry run can
parse this very command line on a CPU machine (and `check_commands(args)` where the script
starts further commands of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

NEEDS_CUDA = 2  # exit status of a stage script that found no CUDA device


@dataclass(frozen=True)
class Script:
    """`python PATH ARGS --out WORK/RESULT`; the JSON it writes becomes the stage record's `result`."""

    path: str
    args: tuple[str, ...]
    result: str


@dataclass(frozen=True)
class Pytest:
    """`python -m pytest -m MARKER TARGETS`; no targets: every test file that uses the `gpu` marker,
    so a module without one (and its imports) is never collected on the device."""

    marker: str
    targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stage:
    name: str
    proves: str
    commands: tuple[Script | Pytest, ...]
    timeout_s: int
    """Its own limit (cut further to what is left of the call's budget)."""
    expected_s: int
    """A guess at its length on an H100 until a run records one (`seconds` in its record): it starts
    only while this much of the call's budget is left, so that `all` fills each call."""


ENV = Stage(
    "env",
    "the machine and its ceilings: copy GB/s and bf16 GEMM TFLOP/s, which every ratio divides by",
    (Script("bench/gpu/gpu_env.py", (), "env.json"),),
    120,
    20,
)

STAGES = (
    Stage(
        "tests",
        "first, every Triton kernel compiles with this machine's Triton for sm_90a and sm_100a at the "
        "runtime's own launch configurations (no communication kernel spills; their PTX keeps the "
        "protocol's ordering, bounded waits and 128-bit copies); then every gpu-marked test (each Triton "
        "kernel in bf16 at real shapes, CUDA-graph replay of the MoE kernels, whole models in bf16) and the "
        "whole-model tests on CUDA in fp32 (Triton = torch greedy tokens; transformers' greedy tokens)",
        (
            Script("bench/gpu/compile_check.py", (), "kernel_resources.json"),
            Pytest("gpu"),
            Pytest("not gpu", ("tests/kernels/test_model_kernels.py", "tests/parity/test_transformers_parity.py")),
        ),
        420,
        300,
    ),
    Stage(
        "parity",
        "transformers vs moeserve on CUDA per architecture, fp32 and bf16, --kernels torch and triton: "
        "prefill logit error and greedy tokens",
        (Script("bench/gpu/parity.py", ("--device", "cuda"), "parity.json"),),
        240,
        150,
    ),
    Stage(
        "kernels",
        "fused MoE GEMM vs torch._grouped_mm and a per-expert loop at DeepSeek-V3/Qwen3/Mixtral shapes, "
        "as fractions of the copy bandwidth (decode) and the bf16 GEMM rate (prefill); the block-scaled "
        "FP8 (w8a8) linear and fused MoE against their bf16 paths, side by side (speedup ratios)",
        (
            Script("bench/moe_kernel.py", (), "moe_kernel.json"),
            Script("bench/fp8_gemm.py", (), "fp8_gemm.json"),
        ),
        360,
        240,
    ),
    Stage(
        "decode",
        "the engine's decode step (Triton and torch kernels) against its HBM roofline and transformers",
        (Script("bench/decode_step.py", (), "decode_step.json"),),
        300,
        200,
    ),
    Stage(
        "serve",
        "moeserve launch on the GPU under moeserve bench serve: output tokens/s at capacity, SLO attainment "
        "at a Poisson rate, the server's own SLO counters cross-checked",
        (Script("bench/gpu/serve.py", (), "serve.json"),),
        300,
        150,
    ),
    Stage(
        "dispatch",
        "first the put path: every row, signal and credit an NVSHMEM put (nvlink_domain_size 0), one GPU "
        "putting to itself and, on a multi-GPU machine, its GPUs to each other with NVSHMEM_DISABLE_P2P=1 "
        "(the NIC's path, where it has one), bit-equal to local; then the nvshmem backend's kernels "
        "bit-equal to local on emulated PEs and over symmetric memory, then "
        "their latency, bandwidth and overlap (against the longer alone and the serial sum) at DeepSeek-V3's "
        "shape; then bit-equal again with every emulated PE on its own thread and stream, nothing but the "
        "kernels' signals and credits ordering them",
        (
            Script("bench/dispatch_puts.py", ("--world-timeout", "90"), "dispatch_puts.json"),
            Script("bench/dispatch.py", ("--time-limit", "240", "--stall-limit", "90"), "dispatch.json"),
            Script(
                "bench/dispatch.py",
                ("--concurrent", "--time-limit", "120", "--stall-limit", "60"),
                "dispatch_concurrent.json",
            ),
        ),
        540,
        430,
    ),
)
