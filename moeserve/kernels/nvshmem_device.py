"""NVSHMEM's device API as Triton externs: the calls `peer_copy`'s put variants make to reach peers
that have no load/store address (other nodes, over IBGDA).

Declared here rather than taken from PyTorch's `_nvshmem_triton`, which offers only the blocking
put-with-signal and refuses to load without a GPU: the kernels post non-blocking puts (the send
returns and the receive step is the overlap hook), and the compile check must build them on a
machine with no GPU. The puts are called by every thread of a program with the same scalar
arguments, which is what NVSHMEM's `_block` variants expect: the program cooperates on one put.
`signal_op` and `fence` are thread-level calls: a kernel makes them from one thread alone
(`if thread_index() == 0`, after a block barrier), since every call is an operation of its own
(an IBGDA atomic per thread: 128 for one signal at 4 warps).

Only compiled code reaches these (the put variants with `PUT_NVSHMEM`); the interpreter runs the
emulated put instead. Linking needs the device bitcode `libnvshmem_device*.bc` of an NVSHMEM
install, passed to the launch as `extern_libs` (`device_library`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from triton.language import core

SIGNAL_SET = 9  # NVSHMEM_SIGNAL_SET (nvshmemx_signal_op_t): the signal word takes the value (ADD is 10)
LIB_DIR_VAR = "NVSHMEM_LIB_DIR"  # the variable PyTorch's NVSHMEM support reads for the same file

_I64, _I32 = core.dtype("int64"), core.dtype("int32")


def device_library(arch: int | None = None) -> Path | None:
    """The NVSHMEM device bitcode to link, or None where no NVSHMEM wheel or `NVSHMEM_LIB_DIR` has
    one. Wheels ship one per architecture (`libnvshmem_device_sm_90.bc`), older ones one for all."""
    roots = []
    if os.environ.get(LIB_DIR_VAR):
        roots.append(Path(os.environ[LIB_DIR_VAR]))
    spec = importlib.util.find_spec("nvidia.nvshmem") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) / "lib" for p in spec.submodule_search_locations]
    names = ([f"libnvshmem_device_sm_{arch}.bc"] if arch is not None else []) + ["libnvshmem_device.bc"]
    for root in roots:
        for name in names:
            if (root / name).is_file():
                return root / name
    return None


def extern_libs(arch: int | None = None) -> dict[str, str]:
    """The launch keyword that links NVSHMEM's device code; raises where there is none."""
    path = device_library(arch)
    if path is None:
        raise FileNotFoundError(
            f"no NVSHMEM device bitcode: install an nvidia-nvshmem wheel or set {LIB_DIR_VAR} to its lib directory"
        )
    return {"libnvshmem_device": str(path)}


@core.extern
def thread_index(_semantic=None):
    """This thread's index in its program (`%tid.x`): the guard of the thread-level calls."""
    return core.inline_asm_elementwise(
        "mov.u32 $0, %tid.x;", "=r", [], dtype=_I32, is_pure=True, pack=1, _semantic=_semantic
    )


@core.extern
def anew(*values, _semantic=None):
    """The values unchanged, as new ones the compiler must take as computed here (moved by one
    inline asm with a side effect, which it can neither fold, hoist nor merge): what the put
    variants compute from them is computed after NVSHMEM's last call rather than held across it
    (`peer_copy`'s CALLS). Integer scalars and pointers."""
    ints = [value.to(_I64, _semantic=_semantic) if value.dtype.is_ptr() else value for value in values]
    wide = [value.dtype.primitive_bitwidth == 64 for value in ints]
    asm = " ".join(f"mov.b{64 if w else 32} ${i}, ${i + len(ints)};" for i, w in enumerate(wide))
    constraints = ",".join(["=l" if w else "=r" for w in wide] + ["l" if w else "r" for w in wide])
    moved = core.inline_asm_elementwise(
        asm, constraints, ints, dtype=[value.dtype for value in ints], is_pure=False, pack=1, _semantic=_semantic
    )
    return tuple(new.to(old.dtype, _semantic=_semantic) for new, old in zip(moved, values))


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, signal, value, pe, _semantic=None):
    """`nbytes` from local `source` to symmetric `dest` on `pe`, then `signal` on `pe` set to `value`:
    NVSHMEM delivers the signal only after the data. Returns once the put is posted."""
    return core.extern_elementwise(
        "",
        "",
        [dest, source, nbytes, signal, value, core.full((), SIGNAL_SET, _I32, _semantic=_semantic), pe],
        {(_I64, _I64, _I64, _I64, _I64, _I32, _I32): ("nvshmemx_putmem_signal_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    """`nbytes` from local `source` to symmetric `dest` on `pe`, unordered until a fence or quiet."""
    return core.extern_elementwise(
        "",
        "",
        [dest, source, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def signal_op(signal, value, pe, _semantic=None):
    """Set symmetric word `signal` on `pe` to `value`, ordered after this PE's fenced puts to `pe`."""
    return core.extern_elementwise(
        "",
        "",
        [signal, value, core.full((), SIGNAL_SET, _I32, _semantic=_semantic), pe],
        {(_I64, _I64, _I32, _I32): ("nvshmemx_signal_op", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def fence(_semantic=None):
    """Puts to a PE posted before this are delivered before those posted after it."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic)


def init_linked_modules(init_module: Callable[[int], None]) -> None:
    """Have every kernel compiled from now on that links NVSHMEM's device code initialise it in its
    CUDA module (NVSHMEM's device state is per module), as PyTorch's `requires_nvshmem` does for
    its own kernels: through Triton's one post-compile hook, chained to any hook already set.
    init_module: the heap's (`init_module(handle)`), so the device state comes from the NVSHMEM
    that started the heap, PyTorch's or nvshmem4py's. GPU only; it runs no device code itself."""
    import triton

    previous = triton.knobs.runtime.jit_post_compile_hook
    if getattr(previous, "links_nvshmem", False):
        return

    def hook(*args, **kwargs) -> None:
        if previous is not None:
            previous(*args, **kwargs)
        jit_function = kwargs["fn"].jit_function
        cache = jit_function.device_caches[kwargs["compile"]["device"]][0]
        kernel = cache.get(kwargs["key"])
        if kernel is not None and "nvshmem" in kernel.asm.get("ptx", ""):
            kernel.run  # noqa: B018  (loads the module: PyTorch's hook does the same)
            init_module(kernel.module)

    hook.links_nvshmem = True
    triton.knobs.runtime.jit_post_compile_hook = hook
