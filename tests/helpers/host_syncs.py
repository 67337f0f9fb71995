"""Count host syncs by where they happen: inside an MoE block's forward or elsewhere.

A host sync is any call that needs a device tensor's values on the host: `Tensor.tolist`,
`.item`, `.cpu`, `.numpy`, the Python conversions (`bool`, `int`, `float`, `__index__`), and
the uploads of values the host computed (usually from a sync just before): `torch.tensor` built
from a Python list or tuple, and `torch.frombuffer` (how `ops.host_ints` packs ints). On CPU
none of these stalls anything, which is exactly why they are counted rather than timed: the
same code on a GPU would stall.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

TENSOR_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
UPLOADS = ("torch.tensor(list)", "torch.frombuffer")
"""How the counter names an upload of host-computed values."""


@dataclass
class HostSyncs:
    """Calls seen, each as "name at file:line", split by whether an MoE forward was running."""

    inside_moe: list[str] = field(default_factory=list)
    outside_moe: list[str] = field(default_factory=list)


class HostSyncCounter:
    """Context manager: patches the sync-making calls and hooks every module of `moe_blocks`.

    with HostSyncCounter(blocks) as syncs:
        model(...)
    assert not syncs.inside_moe
    """

    def __init__(self, moe_blocks: Iterable[nn.Module]) -> None:
        self.blocks = list(moe_blocks)
        self.syncs = HostSyncs()
        self._depth = 0
        self._saved: dict[str, object] = {}
        self._hooks: list = []

    def _record(self, name: str) -> None:
        caller = traceback.extract_stack(limit=3)[0]
        entry = f"{name} at {caller.filename}:{caller.lineno}"
        (self.syncs.inside_moe if self._depth else self.syncs.outside_moe).append(entry)

    def _wrap_method(self, name: str):
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            self._record(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return original, counted

    def __enter__(self) -> HostSyncs:
        for name in TENSOR_METHODS:
            self._saved[name], counted = self._wrap_method(name)
            setattr(torch.Tensor, name, counted)
        original_tensor = torch.tensor
        self._saved["torch.tensor"] = original_tensor

        def counted_tensor(data, *args, **kwargs):
            if isinstance(data, (list, tuple)):
                self._record("torch.tensor(list)")
            return original_tensor(data, *args, **kwargs)

        torch.tensor = counted_tensor
        original_frombuffer = torch.frombuffer
        self._saved["torch.frombuffer"] = original_frombuffer

        def counted_frombuffer(*args, **kwargs):
            self._record("torch.frombuffer")
            return original_frombuffer(*args, **kwargs)

        torch.frombuffer = counted_frombuffer
        for block in self.blocks:
            self._hooks.append(block.register_forward_pre_hook(self._enter_moe))
            self._hooks.append(block.register_forward_hook(self._leave_moe))
        return self.syncs

    def _enter_moe(self, module, args) -> None:
        self._depth += 1

    def _leave_moe(self, module, args, output) -> None:
        self._depth -= 1

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        torch.tensor = self._saved.pop("torch.tensor")
        torch.frombuffer = self._saved.pop("torch.frombuffer")
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
