"""The PTX rules of the communication kernels (`bench/gpu/ptx_rules.py`) hold on the kernels as
compiled for sm_90a on this CPU machine, and each rule catches the regression it is there for.

The put variants (NVSHMEM's puts, for peers on other nodes) are compiled too where NVSHMEM's
device library is installed (an nvidia-nvshmem wheel; CI installs one), and skipped with the
reason otherwise.

The compile runs in a child process: a test worker may have set TRITON_INTERPRET=1 (the kernel
tests do), which makes every kernel an interpreted function with no PTX.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
sys.path.insert(0, str(GPU))

from ptx_rules import _kernel_body, check_comm_ptx, check_put_ptx, unguarded_calls  # noqa: E402

from moeserve.kernels.nvshmem_device import device_library  # noqa: E402

# Compiles three kernels the way a dispatcher launches them on a GPU (DeepSeek-V3's bf16 rows at
# EP 8: 3584 words), with per-call ints at 1, and prints their PTX as JSON; with argv[2] == "put",
# dispatch_send's and give_credit's put variants (two nodes of 4 ranks) too.
COMPILE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from compile_check import JITFunction, StandInDriver
from triton.runtime.driver import driver
from moeserve.kernels import peer_copy as pc
driver.set_active(StandInDriver(90))
i64, err = torch.zeros(64, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
payload = torch.zeros(4, 3584, dtype=torch.int32)
clock = dict(GLOBALTIMER=True, HOST_CLOCK=None)
tiles = dict(zip(("BLOCK_M", "BLOCK_W"), pc.copy_tiles(3584, "cuda")))
kernels = {
    "dispatch_send_kernel": (
        pc.dispatch_send_kernel,
        (i64, payload, i64, i64, i64, err, 1, 1, 1, 1, 1, 0, 16, 32, 48, 64, 80, 10**11),
        dict(EP=8, L=32, C=128, K=8, SLOTS=2, WORDS=3584, **tiles, **clock, KIND=0, DOMAIN=8),
    ),
    "wait_signals_kernel": (pc.wait_signals_kernel, (i64, err, 1, 64, 1, i64, 1, 1, 10**11, 2),
        dict(NUM_WORDS=256, BLOCK=256, **clock)),
    "give_credit_kernel": (pc.give_credit_kernel, (i64, 1, 1, 1, 64), dict(EP=8, PUT=0, DOMAIN=8)),
}
if sys.argv[2] == "put":
    from moeserve.kernels.nvshmem_device import extern_libs
    for name in ("dispatch_send_kernel", "give_credit_kernel"):
        kernel, args, kw = kernels[name]
        kind = "KIND" if "KIND" in kw else "PUT"
        kernels[name + "[put]"] = (kernel, args, dict(kw, DOMAIN=4, extern_libs=extern_libs(90), **{kind: 2}))
    kernel, args, kw = kernels["give_credit_kernel[put]"]  # no load/store peer (nvlink_domain_size 0)
    kernels["give_credit_kernel[all_puts]"] = (kernel, args, dict(kw, DOMAIN=0))
ptx = {n: JITFunction.run(k, *args, grid=(1,), warmup=True, **kw).asm["ptx"] for n, (k, args, kw) in kernels.items()}
ptx = {n: text[text.find(".entry"):] for n, text in ptx.items()}  # the kernels, not NVSHMEM's linked code
print(json.dumps(ptx))
"""


NVSHMEM = device_library(90) is not None
needs_nvshmem = pytest.mark.skipif(not NVSHMEM, reason="no NVSHMEM device library (install an nvidia-nvshmem wheel)")


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    variants = "put" if NVSHMEM else "store"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(GPU), variants],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernels_as_built_keep_every_rule(ptx: dict[str, str]) -> None:
    for name, text in ptx.items():
        kernel = name.split("[")[0]
        copies, problems = check_comm_ptx(kernel, text, put=name != kernel, load_store_peers="all_puts" not in name)
        assert problems == [], f"{name}: {problems}"
        assert copies is (True if kernel == "dispatch_send_kernel" else None)


@needs_nvshmem
def test_the_put_variants_call_nvshmem_and_store_into_no_peer(ptx: dict[str, str]) -> None:
    """NVSHMEM's entry points are inlined: what shows them is the call of their transfer routines."""
    assert re.search(r"call\.uni _Z\d+nvshmemi_transfer_put_signal", ptx["dispatch_send_kernel[put]"])
    assert ".sys.release.exch" not in ptx["dispatch_send_kernel[put]"]
    assert re.search(r"call\.uni _Z\d+nvshmemi_transfer_amo_nonfetch", ptx["give_credit_kernel[put]"])


@needs_nvshmem
def test_the_put_rule_catches_a_put_launch_that_stores_into_peers(ptx: dict[str, str]) -> None:
    """A put launch compiled with the store path (the constexpr branch taken wrongly, or a store
    into a peer added beside the put): its rows and signal would go to an address that a peer on
    another node does not have."""
    _, problems = check_comm_ptx("dispatch_send_kernel", ptx["dispatch_send_kernel"], put=True)
    assert any("never calls NVSHMEM's nvshmemi_transfer_put_signal" in p for p in problems), problems
    assert any("store path's release exchange" in p for p in problems), problems
    signal = next(line for line in ptx["dispatch_send_kernel"].splitlines() if ".sys.release.exch" in line)
    put = ptx["dispatch_send_kernel[put]"]
    end = put.find("\n}", put.find(".entry"))  # the kernel's closing brace: the signal goes just before it
    both = f"{put[:end]}\n{signal}{put[end:]}"
    _, problems = check_comm_ptx("dispatch_send_kernel", both, put=True)
    assert problems == ["the put variant holds the store path's release exchange (a store into a peer)"]


@needs_nvshmem
def test_with_no_load_store_peer_every_credit_is_a_put(ptx: dict[str, str]) -> None:
    """At `DOMAIN` 0 the credit kernels' put variants keep no store path: a release max into a
    peer there (the in-domain branch compiled in) is caught, as is one with no NVSHMEM call."""
    all_puts, split = ptx["give_credit_kernel[all_puts]"], ptx["give_credit_kernel[put]"]
    assert ".release.max" not in all_puts and ".release.max" in split
    _, problems = check_comm_ptx("give_credit_kernel", split, put=True, load_store_peers=False)
    assert problems == ["the put variant for no load/store peer holds the store path's credit (a store into a peer)"]
    _, problems = check_comm_ptx("give_credit_kernel", ptx["give_credit_kernel"], put=True, load_store_peers=False)
    assert any("never calls NVSHMEM's nvshmemi_transfer_amo" in p for p in problems), problems


@needs_nvshmem
def test_signal_ops_and_fences_are_one_threads_and_set_their_word(ptx: dict[str, str]) -> None:
    """A thread-level NVSHMEM call made by every thread of a program is one operation per thread
    (128 IBGDA atomics for one credit at 4 warps): each sits behind a branch on `%tid.x`; and a
    signal operation passes NVSHMEM_SIGNAL_SET (9), not 0, which NVSHMEM's load/store path adds
    and its transfer does not know. Without the `%tid.x` guard, or with 0, the rules say so."""
    for name in ("give_credit_kernel[put]", "give_credit_kernel[all_puts]", "dispatch_send_kernel[put]"):
        assert check_put_ptx(name.split("[")[0], ptx[name], "all_puts" not in name) == [], name
        unguarded = ptx[name].replace("%tid.x", "%ctaid.x")  # the guard compares the block, not the thread
        problems = check_put_ptx(name.split("[")[0], unguarded, "all_puts" not in name)
        assert any("every thread of a program makes the thread-level call" in p for p in problems), (name, problems)
    assert "[param3], 9;" in ptx["give_credit_kernel[put]"]
    added = ptx["give_credit_kernel[put]"].replace("[param3], 9;", "[param3], 0;")
    assert check_put_ptx("give_credit_kernel", added) == ["a signal operation passes amo type(s) [0], not SET (9)"]


def test_the_rule_catches_a_signal_released_before_the_block_barrier(ptx: dict[str, str]) -> None:
    """The release exchange is one thread's; the rows it publishes are every thread's: a block
    barrier must come between, else a receiver running concurrently sees the signal first."""
    text = ptx["dispatch_send_kernel"]
    unordered = "\n".join(line for line in text.splitlines() if not line.strip().startswith("bar.sync"))
    assert unordered != text
    _, problems = check_comm_ptx("dispatch_send_kernel", unordered)
    assert problems == ["1 release exchange(s) follow the rows' stores with no block barrier between"]


@pytest.mark.parametrize(
    "kernel,old,new,finding",
    [
        ("dispatch_send_kernel", ".sys.release.exch", ".gpu.release.exch", "release exchange"),
        ("dispatch_send_kernel", ".sys.acquire", ".sys.relaxed", "acquire loads"),
        ("wait_signals_kernel", "%globaltimer", "%clock64", "bounded by the global timer"),
        ("give_credit_kernel", ".release.max", ".release.exch", "release max"),
        ("dispatch_send_kernel", ".v4.b32", ".b32", "scalar loads/stores"),
        ("wait_signals_kernel", "ld.volatile.", "ld.", "re-read the error word"),
    ],
    ids=[
        "signal_at_gpu_scope",
        "relaxed_wait",
        "unbounded_wait",
        "credit_stored_not_raised",
        "scalar_copies",
        "error_read_once",
    ],
)
def test_each_rule_catches_its_regression(ptx: dict[str, str], kernel: str, old: str, new: str, finding: str) -> None:
    assert old in ptx[kernel], f"{kernel}'s PTX no longer has {old!r}: update this test's regression"
    _, problems = check_comm_ptx(kernel, ptx[kernel].replace(old, new))
    assert any(finding in p for p in problems), problems


_FOLDED = """.entry k()
{
	mov.u32 	%r6, %ctaid.x;
	mov.u32 %r5, %tid.x;
	or.b32 	%r7, %r6, %r5;
	setp.ne.b32 	%p1, %r7, 0;
	@%p1 bra 	$L__BB0_2;
	call.uni _Z30nvshmemi_transfer_amo_nonfetchImEvPvT_i14nvshmemi_amo_t, (param0, param1, param2, param3);
$L__BB0_2:
	ret;
}"""


@pytest.mark.parametrize(
    "old,new,unguarded",
    [("", "", 0), ("or.b32 \t%r7, %r6, %r5;", "and.b32 \t%r7, %r6, %r5;", 1), ("@%p1 bra", "@!%p1 bra", 1)],
    ids=["program_and_thread_folded", "and_is_no_guard", "branch_the_wrong_way"],
)
def test_the_thread_guard_as_the_compiler_folds_it(old: str, new: str, unguarded: int) -> None:
    """Where the program is known (one destination), the compiler folds `program 0, thread 0` into
    one `or` of %ctaid.x and %tid.x: still a guard. An `and`, or the branch taken the wrong way
    (every thread but 0 falling through to the call), is none."""
    assert len(unguarded_calls(_FOLDED.replace(old, new))) == unguarded


def test_a_kernel_body_runs_to_its_end_label() -> None:
    """An inline asm block's closing brace may start a line: the body runs to the brace after
    `$L__func_end`, else branch targets past the asm block go missing (the compile check crashed
    on the Mixtral dispatch's control flow with a KeyError)."""
    asm = _FOLDED.replace("$L__BB0_2:", "{\n\t.reg .b32 %t;\n}\n$L__BB0_2:").replace(
        "\tret;\n}", "\tret;\n$L__func_end0:\n}"
    )
    assert "$L__BB0_2:" in _kernel_body(asm, "k")
    assert unguarded_calls(_kernel_body(asm, "k")) == []
