"""The GPU runbook's stages: what each one runs, what it proves, and how long it may take.

Paths are relative to the repository root. A stage's commands all run even when one fails; the
stage passes when every command exits 0. Scripts take `--out FILE` (added by the runbook) and
exit 2 when there is no CUDA device; each exposes `parse_args(argv)` so that the dry run can
parse this very command line on a CPU machine (and `check_commands(args)` where the script
starts further commands of its own).

Sizing. A lent device gives one H200 for 15 minutes in all (its start included), at most 600 s a
command; so the runbook's default call (`ORDER`) must prove the most in one 600 s command, the
path only a GPU can prove (NVSHMEM's puts) first. Each stage's estimate is the compile time of
the kernels it builds, measured, plus a guess at the rest until a device run records the stage's
`seconds`. The compile times are CPU-seconds (the process's and its ptxas children's, which a
shared machine does not inflate as it does the wall clock), per case of the compile check, for
sm_90a only, under Triton 3.6 (the device's) with nvidia-nvshmem-cu13 3.4.5 (the check always
compiles into an empty cache of its own):

    python bench/gpu/compile_check.py --arch 90 --nvshmem

on the 2-core CPU machine where the project is built (2026-11-28; `case_cpu_seconds` in its
output; the check then ran ptxas a second time itself, so they overstate a device's compile a
little). One ptxas runs per kernel, so a GPU machine's 16 cores compile no slower. The kernels'
own waits for a peer time out at `PEER_TIMEOUT_S` (the runbook sets the dispatcher's
`MOESERVE_PEER_TIMEOUT_S` for every stage), below every watchdog a stage or its scripts keep,
so a protocol hang is reported as the kernels' `PeerTimeout` naming the phase and the peer
rather than as a watchdog's kill.
"""

from __future__ import annotations

from dataclasses import dataclass

NEEDS_CUDA = 2  # exit status of a stage script that found no CUDA device
CALL_S = 600  # one device command's limit
PEER_TIMEOUT_S = 30  # the communication kernels' wait bound in every stage (the product's default is 100 s)

# Measured compile CPU-seconds (module docstring), and what each stage builds of them.
COMPILE_S = {
    "puts": 21,  # the put variants at one shape ("nvshmem puts only ...", EP 1): dispatch_puts builds two
    "comm": 7,  # the store-path kernels at Mixtral's and DeepSeek-V3's shapes (1.6 s + 5.9 s)
    "kernels": 30,  # every other kernel at the check's shapes; the gpu tests build about three times as many
}


@dataclass(frozen=True)
class Script:
    """`python PATH ARGS --out WORK/RESULT`; the JSON it writes becomes the stage record's `result`."""

    path: str
    args: tuple[str, ...]
    result: str


@dataclass(frozen=True)
class Pytest:
    """`python -m pytest -m MARKER TARGETS`; no targets: every test file that uses the `gpu` marker
    but those in `exclude`, so a module without one (and its imports) is never collected on the
    device. `per_file`: one process per file, so that a sticky CUDA error (an illegal address
    poisons the process's context) fails that file's tests only."""

    marker: str
    targets: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    per_file: bool = False


@dataclass(frozen=True)
class Stage:
    name: str
    proves: str
    commands: tuple[Script | Pytest, ...]
    timeout_s: int
    """Its own limit (cut further to what is left of the call's budget)."""
    expected_s: int
    """Its estimate (module docstring): it starts only while this much of the call's budget is
    left, so that a call fills its budget and never outruns it."""


ENV = Stage(
    "env",
    "the machine and its ceilings: copy GB/s and bf16 GEMM TFLOP/s, which every ratio divides by",
    (Script("bench/gpu/gpu_env.py", (), "env.json"),),
    60,
    20,
)

# The NVSHMEM path's own tests, run by the puts stage (and so left out of the tests stage).
NVSHMEM_TESTS = ("tests/unit/test_nvshmem_steps_and_refusals.py", "tests/distributed/test_nvshmem4py_host.py")

STAGES = (
    Stage(
        "puts",
        "the put path first, the one thing only a GPU proves: every row, signal and credit an NVSHMEM put "
        "(nvlink_domain_size 0), one GPU putting to itself and, on a multi-GPU machine, its GPUs to each other "
        "with NVSHMEM_DISABLE_P2P=1 (the NIC's path, where it has one), bit-equal to local; then the nvshmem "
        "backend's gpu-marked tests (its steps and refusals on CUDA, nvshmem4py's host)",
        (
            Script("bench/dispatch_puts.py", ("--world-timeout", "150"), "dispatch_puts.json"),
            Pytest("gpu", NVSHMEM_TESTS, per_file=True),
        ),
        240,
        60 + 2 * COMPILE_S["puts"],  # NCCL's and NVSHMEM's start-up and two pytest processes, beside the compiles
    ),
    Stage(
        "tests",
        "every gpu-marked test, one process per file (each Triton kernel in bf16 at real shapes, CUDA-graph "
        "replay of the MoE kernels, whole models in bf16), and the whole-model tests on CUDA in fp32 (Triton = "
        "torch greedy tokens; transformers' greedy tokens); the compile check is CI's (both Triton versions)",
        (
            Pytest("gpu", exclude=NVSHMEM_TESTS, per_file=True),
            Pytest(
                "not gpu",
                ("tests/kernels/test_model_kernels.py", "tests/parity/test_transformers_parity.py"),
                per_file=True,
            ),
        ),
        330,
        150 + 3 * COMPILE_S["kernels"],  # 14 processes' start-up (torch, CUDA) and the tests' own time
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
        "serve",
        "moeserve launch on the GPU under moeserve bench serve: output tokens/s at capacity, SLO attainment "
        "at a Poisson rate, the server's own SLO counters cross-checked",
        (Script("bench/gpu/serve.py", (), "serve.json"),),
        300,
        150,
    ),
    Stage(
        "dispatch",
        "the nvshmem backend's kernels bit-equal to local on emulated PEs and over symmetric memory, then "
        "their latency, bandwidth and overlap (against the longer alone and the serial sum) at DeepSeek-V3's "
        "shape; then bit-equal again with every emulated PE on its own thread and stream, nothing but the "
        "kernels' signals and credits ordering them",
        (
            Script("bench/dispatch.py", ("--time-limit", "240", "--stall-limit", "90"), "dispatch.json"),
            Script(
                "bench/dispatch.py",
                ("--concurrent", "--time-limit", "120", "--stall-limit", "60"),
                "dispatch_concurrent.json",
            ),
        ),
        420,
        300 + 2 * COMPILE_S["comm"],  # FP8 rows compile their own variants
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
)
ORDER = tuple(s.name for s in STAGES)
"""`all`'s order, and that of a call naming no stage: the NVSHMEM path, then the tests, then the rest."""
BY_NAME = {s.name: s for s in STAGES}


def chosen(names: list[str]) -> list[Stage]:
    """The stages named, in the order named (`all`, or no name: `ORDER`), each once."""
    expanded = [n for name in names or ["all"] for n in (ORDER if name == "all" else (name,))]
    return [BY_NAME[n] for n in dict.fromkeys(expanded)]


def plan(stages: list[Stage], budget_s: float) -> list[tuple[Stage, float | None]]:
    """(stage, the second of the call's budget it is expected to start at, or None where it is
    left to the next call): the runbook's own rule with every stage taking its estimate, `ENV`
    first. A stage that does not fit leaves room for a later, shorter one."""
    at = float(ENV.expected_s)
    planned: list[tuple[Stage, float | None]] = []
    for stage in stages:
        fits = budget_s <= 0 or at + stage.expected_s <= budget_s
        planned.append((stage, at if fits else None))
        at += stage.expected_s if fits else 0
    return planned
