"""`LayerOps` backends by name, each able to say why it cannot run on a device.

Backends are imported only when chosen: the Triton backend pulls in triton and compiles
kernels, which a CPU server never needs.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from moeserve.ops.base import LayerOps


@dataclass(frozen=True)
class _Backend:
    module: str
    cls: str
    requires: tuple[str, ...] = ()
    """Packages that must be installed before the module can be imported."""

    def load(self) -> type[LayerOps]:
        missing = [package for package in self.requires if importlib.util.find_spec(package) is None]
        if missing:
            raise ValueError(f"needs the {', '.join(missing)} package (pip install 'moeserve[gpu]')")
        return getattr(importlib.import_module(self.module), self.cls)


OPS_BACKENDS: dict[str, _Backend] = {
    "torch": _Backend("moeserve.ops.torch_ops", "TorchOps"),
    "triton": _Backend("moeserve.ops.triton_ops", "TritonOps", requires=("triton",)),
}

# The Triton kernels have passed only under the interpreter (fp32/fp16, CPU); until their bf16
# tests have passed on a GPU, "auto" keeps GPUs on the torch path and triton is opt-in.
TRITON_VERIFIED_ON_GPU = False


def _auto(device: torch.device) -> str:
    if device.type == "cuda" and TRITON_VERIFIED_ON_GPU and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def create_ops(name: str, device: torch.device | str) -> LayerOps:
    """The backend for `name` ("auto": Triton's kernels on CUDA once they are verified there and
    triton is installed, else torch). Asking for a backend that cannot run is an error naming
    the reason, not a silent fallback."""
    device = torch.device(device)
    if name == "auto":
        name = _auto(device)
    if name not in OPS_BACKENDS:
        raise ValueError(f"unknown kernels backend {name!r}; use auto or one of {', '.join(OPS_BACKENDS)}")
    try:
        backend = OPS_BACKENDS[name].load()
    except ValueError as e:
        raise ValueError(f"kernels={name} {e}") from None
    reason = backend.supports(device)
    if reason is not None:
        raise ValueError(f"kernels={name} cannot run here: {reason}")
    return backend()
