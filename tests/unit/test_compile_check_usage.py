"""The compile check's registers and spills are those of the cubin Triton builds: read from the
`ptxas -v` log of Triton's own compile (its flags: 3.9 adds `--regAllocOptLevel=2`, which changes
the spills), for the kernel itself rather than the NVSHMEM functions it calls, and read again
when the kernels are already in the user's Triton cache (a cache hit prints no log)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
sys.path.insert(0, str(GPU))

from compile_check import ptxas_usage  # noqa: E402

# As ptxas 13.4 prints it for a put variant, with a called NVSHMEM function's properties put first
# (ptxas prints them after the kernel's; the kernel's must be found wherever they are).
LOG = """\
ptxas info    : 2726 bytes gmem
ptxas info    : Function properties for _Z23nvshmemi_transfer_fenceIL13threadgroup_t0EEviPii
    0 bytes stack frame, 16 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'combine_send_kernel' for 'sm_90a'
ptxas info    : Function properties for combine_send_kernel
    144 bytes stack frame, 16 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 144 bytes cumulative stack size
ptxas info    : Compile time = 4825.449 ms
ptxas info    : Function properties for _Z30nvshmemi_transfer_amo_nonfetchImEvPvT_i14nvshmemi_amo_ti
    0 bytes stack frame, 64 bytes spill stores, 16 bytes spill loads
"""


def test_the_kernels_own_figures_are_read_not_a_called_functions():
    assert ptxas_usage(LOG, "combine_send_kernel") == {
        "registers": 128,
        "stack_bytes": 144,
        "spill_stores": 16,
        "spill_loads": 40,
    }


def test_a_log_without_the_kernel_is_an_error_not_zeros():
    with pytest.raises(RuntimeError, match="no ptxas usage for dispatch_send_kernel"):
        ptxas_usage(LOG, "dispatch_send_kernel")
    with pytest.raises(RuntimeError, match="no ptxas usage for combine_send"):
        ptxas_usage(LOG.replace("combine_send_kernel", "combine_send_kernel_2"), "combine_send")


def test_figures_come_back_when_the_kernels_are_already_in_the_users_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # the user's cache, warm on the second run
    figures = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        done = subprocess.run(
            [sys.executable, str(GPU / "compile_check.py"), "--arch", "90", "--only", "norm", "--out", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        kernels = json.loads(out.read_text())["kernels"]
        assert kernels and all(k["registers"] > 0 for k in kernels)
        figures.append(sorted((k["kernel"], k["registers"], k["stack_bytes"], k["spill_stores"]) for k in kernels))
    assert figures[0] == figures[1]
