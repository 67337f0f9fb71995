"""Compile every Triton kernel of `moeserve/kernels` for Hopper and Blackwell on a machine with no
GPU, through the launch path a GPU would take, and check what the compiler made of it.

Triton's CUDA backend ships `ptxas`, so PTX and cubins for `sm_90a`/`sm_100a` can be built
anywhere; what needs a device is only the launch. A stand-in driver hands Triton's own binder the
target, so each argument is specialized exactly as a real launch would (an int equal to 1 becomes
a constant, a pointer divisible by 16 is marked so), and `JITFunction.run(..., warmup=True)`
compiles without launching. The launches themselves come from the real launching code: the
cases in `compile_cases.py` call the kernels' public wrappers (and the `nvshmem` dispatcher on
emulated PEs) at real models' shapes under `targets.compile_only`, and every launch they make is
intercepted here and compiled for each target, never run. The dispatcher's host side runs for
real, so its launches carry the ints a GPU's would (`seq == 1` on the first call, then 2, 3 ...
through both ring slots; rank 1 on half the ranks); the communication kernels' tiles and clock,
which differ on a CPU transport, are taken as a GPU's (`compile_cases.interpreted_kernels`).

For each compiled kernel the `ptxas -v` log of Triton's own compile (its flags, its ptxas) gives
registers, spills, stack (local memory), and Triton's metadata gives shared memory. It fails on
any compile error, any spill in a communication kernel (the put variants included), shared memory
over the architecture's limit, and any communication kernel whose PTX breaks the protocol's memory
ordering or moves its payload narrower than 128 bits (`ptx_rules`). Results go to
`bench/results/kernel_resources.json`.

The put variants of the communication kernels (`[put]` in the table: peers on other nodes, reached
by NVSHMEM's device API) are linked against NVSHMEM's device bitcode for each target, from an
nvidia-nvshmem wheel on the path or `NVSHMEM_LIB_DIR`; without one they are skipped with a printed
reason, and `--nvshmem` makes that an error (CI passes it). Link the NVSHMEM torch's CUDA build
pins (3.4.5 for torch 2.11 to 2.13), the one the kernels run with: NVSHMEM refuses device code of
another version than its host library. (From 3.7 its transfer routines are calls, not inlined, and
the put variants spill what they hold across them.)

    python bench/gpu/compile_check.py [--arch 90 100] [--only peer_copy ...] [--nvshmem] [--out FILE]

Runs on CPU machines (CI) and GPU machines alike: nothing is ever launched on a device.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata as metadata
import io
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from ptx_rules import COMM_MODULE, PUT_NVSHMEM, check_comm_ptx  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "kernel_resources.json"
ARCH_NAMES = {90: "sm_90a (H100/H200)", 100: "sm_100a (B200)"}
# Bytes of shared memory one block may opt into: 227 KiB on both Hopper and Blackwell datacenter parts.
SHARED_MEMORY_LIMIT = {90: 232448, 100: 232448}


class StandInDriver(DriverBase):
    """What Triton's binder and compiler ask of a driver, for a GPU that is not here. Each target
    reports its own device number, so the JIT caches of the two targets never mix."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)
        self.arch = arch

    @staticmethod
    def is_active() -> bool:
        return False

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self):
        raise RuntimeError("the stand-in driver launches nothing")

    def get_device_interface(self):
        raise RuntimeError("the stand-in driver launches nothing")

    def get_empty_cache_for_benchmark(self):
        raise RuntimeError("the stand-in driver launches nothing")

    def clear_cache(self, cache) -> None:
        pass


@dataclass
class Compiled:
    """One kernel specialization compiled for one architecture."""

    kernel: str
    module: str
    arch: int
    case: str
    specialization: str
    constexprs: str
    num_warps: int = 0
    num_stages: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    copies_128bit: bool | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Failure:
    kernel: str
    arch: int
    case: str
    error: str


def ptxas_usage(log: str, kernel: str) -> dict[str, int]:
    """Registers, stack and spills of `kernel`, from the `ptxas -v` log of the compile that built
    it. The log is the one Triton's own ptxas run printed, with Triton's flags (3.9 adds
    `--regAllocOptLevel=2`, which changes the spills): a second ptxas run with flags of our own
    would measure a cubin Triton never builds. The log also holds the properties of every function
    the kernel calls (NVSHMEM's); the kernel's own come first after its name."""
    name = re.escape(kernel)
    frame = re.search(
        rf"Function properties for {name}\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
        rf"(\d+) bytes spill loads",
        log,
    )
    registers = re.search(rf"Compiling entry function '{name}'.*?Used (\d+) registers", log, re.S)
    if frame is None or registers is None:
        raise RuntimeError(f"no ptxas usage for {kernel} in the compile's log:\n{log}")
    return {
        "registers": int(registers.group(1)),
        "stack_bytes": int(frame.group(1)),
        "spill_stores": int(frame.group(2)),
        "spill_loads": int(frame.group(3)),
    }


class CompileCheck:
    """Intercepts every launch while a case runs and compiles it for each architecture."""

    def __init__(self, archs: list[int], nvshmem: bool = False) -> None:
        """nvshmem: compile the put variants (NVSHMEM's device library is there); else count them
        in `skipped_puts`."""
        self.archs = archs
        self.nvshmem = nvshmem
        self.skipped_puts = 0
        self.compiled: dict[tuple[str, int, str], Compiled] = {}
        self.failures: list[Failure] = []
        self.case = ""
        self._on_cuda: dict[object, Callable[[dict], dict]] = {}

    # -- interception -------------------------------------------------------------------------

    def install(self) -> None:
        check = self
        self._jit_run = JITFunction.run

        def jit_run(kernel, *args, grid, warmup, **kwargs):
            adapt = check._on_cuda.get(kernel.fn)
            check.compile_launch(kernel, args, adapt(kwargs) if adapt else kwargs)

        JITFunction.run = jit_run

    def uninstall(self) -> None:
        JITFunction.run = self._jit_run

    def register(self, compiled: JITFunction, on_cuda: Callable[[dict], dict]) -> None:
        """A kernel whose launch on CPU tensors differs from its launch on a GPU (`DeviceKernel`'s
        communication kernels): compile its launches with keywords as `on_cuda` makes them."""
        self._on_cuda[compiled.fn] = on_cuda

    # -- compiling ----------------------------------------------------------------------------

    def compile_launch(self, kernel: JITFunction, args: tuple, kwargs: dict) -> None:
        libraries = kwargs.get("extern_libs")
        if callable(libraries):  # NVSHMEM's device library, one per architecture
            if not self.nvshmem:
                self.skipped_puts += 1
                return
        for arch in self.archs:
            if callable(libraries):
                kwargs = {**kwargs, "extern_libs": libraries(arch)}
            previous = driver.active if torch.cuda.is_available() else None
            driver.set_active(StandInDriver(arch))
            log = io.StringIO()  # Triton prints its ptxas log here (`dump_ptxas_log`, set by `run`)
            try:
                with contextlib.redirect_stdout(log):
                    compiled = self._jit_run(kernel, *args, grid=(1,), warmup=True, **kwargs)
            except Exception as e:  # every compile error is a finding, the check goes on
                self.failures.append(Failure(_name(kernel), arch, self.case, _short_error(e)))
                continue
            finally:
                driver.set_active(previous)
            self._record(kernel, compiled, arch, log.getvalue())

    def _record(self, kernel: JITFunction, compiled, arch: int, log: str) -> None:
        """log: what Triton printed while compiling; empty where the JIT had it already (then the
        kernel was compiled earlier in this run, into its fresh cache, and is recorded)."""
        constants = compiled.src.constants if hasattr(compiled.src, "constants") else {}
        params = kernel.arg_names
        constexprs = {params[path[0]]: value for path, value in constants.items() if len(path) == 1}
        specialization = ", ".join(
            f"{name}={value}" for name, value in constexprs.items() if not _is_declared(kernel, name)
        )
        declared = ", ".join(f"{name}={value}" for name, value in constexprs.items() if _is_declared(kernel, name))
        key = (_name(kernel), arch, compiled.hash)
        if key in self.compiled:
            return
        meta = compiled.metadata
        entry = Compiled(
            kernel=_name(kernel),
            module=kernel.fn.__module__.rsplit(".", 1)[-1],
            arch=arch,
            case=self.case,
            specialization=specialization,
            constexprs=declared,
            num_warps=meta.num_warps,
            num_stages=meta.num_stages,
            shared_bytes=meta.shared,
        )
        ptx = compiled.asm["ptx"]
        for name, value in ptxas_usage(log, compiled.metadata.name).items():
            setattr(entry, name, value)
        if entry.shared_bytes > SHARED_MEMORY_LIMIT[arch]:
            entry.problems.append(f"{entry.shared_bytes} B shared memory > {SHARED_MEMORY_LIMIT[arch]} B")
        if entry.module == COMM_MODULE:
            put = PUT_NVSHMEM in (constexprs.get("KIND"), constexprs.get("PUT"))
            if entry.spill_stores or entry.spill_loads:
                entry.problems.append(f"spills ({entry.spill_stores} B stores, {entry.spill_loads} B loads)")
            load_store_peers = constexprs.get("DOMAIN") != 0  # 0: every peer by puts (`ALL_PUTS`)
            copies, problems = check_comm_ptx(entry.kernel, ptx, put, load_store_peers)
            if put:
                entry.kernel += "[put]"
            entry.copies_128bit = copies
            entry.problems += problems
        self.compiled[key] = entry


def nvshmem_version() -> str | None:
    """The nvidia-nvshmem wheel's version the put variants were linked from; None for a library
    named by `NVSHMEM_LIB_DIR` (which `device_library` prefers) or none at all."""
    from moeserve.kernels.nvshmem_device import LIB_DIR_VAR

    if os.environ.get(LIB_DIR_VAR):
        return None
    for name in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return None


def _name(kernel: JITFunction) -> str:
    return kernel.fn.__name__


def _is_declared(kernel: JITFunction, name: str) -> bool:
    return any(p.name == name and p.is_constexpr for p in kernel.params)


def _short_error(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-12:])


# -- running and reporting ---------------------------------------------------------------------


def cpu_seconds() -> float:
    """This process's CPU time and its finished children's (ptxas): a compile's cost, which a
    machine shared with other work does not inflate as it does the wall clock."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run(archs: list[int], only: list[str] | None, nvshmem: bool) -> tuple[CompileCheck, dict[str, dict[str, float]]]:
    """The check, and per case its seconds: {"wall": {case: s}, "cpu": {case: s}}."""
    import compile_cases

    check = CompileCheck(archs, nvshmem)
    for kernel, on_cuda in compile_cases.interpreted_kernels():
        check.register(kernel, on_cuda)
    seconds: dict[str, dict[str, float]] = {"wall": {}, "cpu": {}}
    # Every kernel compiled here, into a cache of this run's own, so that each one's ptxas runs
    # and prints its log (read by `ptxas_usage`); a cache from an earlier run would print nothing.
    cache = tempfile.TemporaryDirectory(prefix="compile-check-")
    triton.knobs.cache.dir = cache.name
    triton.knobs.nvidia.dump_ptxas_log = True
    check.install()
    try:
        for case in compile_cases.CASES:
            if only and case.module not in only:
                continue
            check.case = case.name
            start, cpu = time.perf_counter(), cpu_seconds()
            try:
                case.run()
            except Exception as e:
                check.failures.append(Failure(case.module, 0, case.name, "the case raised: " + _short_error(e)))
                traceback.print_exc()
            seconds["wall"][case.name] = round(time.perf_counter() - start, 2)
            seconds["cpu"][case.name] = round(cpu_seconds() - cpu, 2)
    finally:
        check.uninstall()
        cache.cleanup()
    if not only:
        compiled = {e.kernel.removesuffix("[put]") for e in check.compiled.values()}
        for name, module in sorted(launched_kernels().items()):
            if name not in compiled:
                check.failures.append(Failure(name, 0, "-", f"{module}.{name} has no case in compile_cases.py"))
    return check, seconds


def launched_kernels() -> dict[str, str]:
    """Every `@triton.jit` function of `moeserve/kernels` that no other one calls (so a kernel that
    is launched, not a helper), by name, with its module: the set the cases must cover, so that a
    kernel added later without a case fails the check rather than going unchecked."""
    import importlib
    import pkgutil

    import moeserve.kernels

    found: dict[str, tuple[str, JITFunction]] = {}
    for info in pkgutil.iter_modules(moeserve.kernels.__path__):
        module = importlib.import_module(f"moeserve.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[name] = (info.name, value)
    called = {name for _, kernel in found.values() for name in kernel.fn.__code__.co_names}
    return {name: module for name, (module, _) in found.items() if name not in called}


def table(check: CompileCheck) -> str:
    header = ("kernel", "arch", "warps", "stages", "regs", "spill B", "stack B", "smem B", "v4 copies", "specialized")
    rows = [header]
    for e in sorted(check.compiled.values(), key=lambda e: (e.module, e.kernel, e.arch, e.specialization)):
        rows.append(
            (
                f"{e.module}.{e.kernel}",
                f"sm_{e.arch}",
                str(e.num_warps),
                str(e.num_stages),
                str(e.registers),
                str(e.spill_stores + e.spill_loads),
                str(e.stack_bytes),
                str(e.shared_bytes),
                "-" if e.copies_128bit is None else ("yes" if e.copies_128bit else "NO"),
                (e.specialization or "-")[:60],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100], choices=sorted(ARCH_NAMES))
    parser.add_argument("--only", nargs="+", help="kernel modules to check (e.g. peer_copy norm); default all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--nvshmem",
        action="store_true",
        help="require NVSHMEM's device library and compile the put variants against it (default: where found)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The kernels must be decorated as compiled JIT functions: under TRITON_INTERPRET=1 (the kernel
    # tests set it) each would be an interpreted one. They are imported below, after this.
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    from moeserve.kernels.nvshmem_device import LIB_DIR_VAR, device_library

    libraries = {arch: device_library(arch) for arch in args.arch}
    missing = [arch for arch, path in libraries.items() if path is None]
    if missing and args.nvshmem:
        print(f"--nvshmem: no NVSHMEM device library for sm_{missing[0]} (an nvidia-nvshmem wheel, or {LIB_DIR_VAR})")
        return 1
    check, seconds = run(args.arch, args.only, nvshmem=not missing)
    if check.skipped_puts:
        print(
            f"SKIPPED {check.skipped_puts} launches of the put variants: no NVSHMEM device library to link "
            f"(install an nvidia-nvshmem wheel or set {LIB_DIR_VAR}; --nvshmem makes this an error)"
        )
    else:
        print("put variants linked with " + ", ".join(f"sm_{a}: {p.name}" for a, p in libraries.items() if p))
    print(table(check))
    problems = [(e, p) for e in check.compiled.values() for p in e.problems]
    kernels = collections.Counter(e.kernel for e in check.compiled.values())
    print(
        f"\ntriton {triton.__version__}: {len(check.compiled)} compiled kernels ({len(kernels)} distinct) for "
        f"{', '.join(ARCH_NAMES[a] for a in args.arch)} in {time.perf_counter() - start:.0f} s; "
        f"{len(check.failures)} compile errors, {len(problems)} problems"
    )
    for f in check.failures:
        print(f"\nCOMPILE ERROR {f.kernel} sm_{f.arch} ({f.case}):\n{f.error}")
    for e, p in problems:
        print(f"PROBLEM {e.module}.{e.kernel} sm_{e.arch} [{e.specialization}]: {p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "triton": triton.__version__,
                "nvshmem": nvshmem_version(),
                "archs": {str(a): ARCH_NAMES[a] for a in args.arch},
                "how": "compiled on a CPU machine through Triton's binder with a stand-in driver; nothing launched",
                "case_seconds": seconds["wall"],
                "case_cpu_seconds": seconds["cpu"],
                "kernels": [asdict(e) for e in check.compiled.values()],
                "compile_errors": [asdict(f) for f in check.failures],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 1 if check.failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
