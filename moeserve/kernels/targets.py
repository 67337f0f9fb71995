"""Where a Triton kernel may be launched: on a CUDA device, or on CPU through Triton's interpreter.

Two ways to reach the interpreter. The model's kernels take it for the whole process when
`TRITON_INTERPRET=1` was set before triton was imported (the kernel tests do this). The
communication kernels must also run on CPU in a process that has a GPU, or that never set the
variable (the shared-memory transport between rank processes), so `DeviceKernel` chooses per
launch, by the device of the tensors it is given.

`compile_only()` is for the compile check (`bench/gpu/compile_check.py`): it compiles every
launch for a GPU target on a machine without one and runs none of them, so the wrappers' device
checks must let CPU tensors through, and `DeviceKernel` must hand out its compiled kernel for
them, while it is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

_compile_only = contextvars.ContextVar("moeserve_kernels_compile_only", default=False)


def interpreting() -> bool:
    """True when triton was told to interpret every kernel of this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Launches inside are compiled for a stand-in GPU target and not run (the compile check)."""
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)


def require_launchable(tensor: torch.Tensor, kernel: str) -> None:
    """Raise a clear error when `kernel` cannot run on `tensor`'s device."""
    if tensor.device.type == "cuda" or interpreting() or _compile_only.get():
        return
    raise ValueError(
        f"{kernel} runs on CUDA, or elsewhere only under TRITON_INTERPRET=1; its input is on {tensor.device}"
    )


class DeviceKernel:
    """A `@triton.jit` kernel launched compiled on CUDA tensors and interpreted on any other.

    `kernel[grid](*args)` looks at the first argument's device at each launch, so one process may
    drive a GPU and a CPU transport alike. The interpreted copy is built on first use: creating it
    costs nothing a process that only uses the GPU should pay.
    """

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
        self._interpreted: Any = None

    @property
    def fn(self) -> Callable:
        return self.compiled.fn

    def interpreted(self) -> Any:
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            if isinstance(self.compiled, InterpretedFunction):
                self._interpreted = self.compiled
            else:
                self._interpreted = InterpretedFunction(self.compiled.fn)
        return self._interpreted

    def for_device(self, device: torch.device) -> Any:
        if device.type == "cuda" or _compile_only.get():
            return self.compiled
        return self.interpreted()

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            return self.for_device(args[0].device)[grid](*args, **kwargs)

        return launch
