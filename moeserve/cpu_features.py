"""Whether this CPU computes bfloat16 natively, which decides what `--dtype auto` runs in on CPU.

Without AVX512_BF16 or AMX-BF16 (x86) or the BF16 extension (Arm), torch's CPU kernels convert
every bf16 operand to float32 and back, so a bf16 model runs several times slower than the same
model in float32 (the demo model's prefill: about 3,000 against 17,000 tokens/s on an AVX2 CPU).

Linux reports the flags in /proc/cpuinfo (`flags` on x86, `Features` on Arm); elsewhere torch's
own CPU probe (`torch.cpu.get_capabilities`) answers. Imports no torch unless it needs that probe.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""x86's AVX512_BF16 and AMX-BF16, Arm's FEAT_BF16 (`bf16` in /proc/cpuinfo and in torch's probe)."""

_CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of a /proc/cpuinfo text: the `flags` (x86) and `Features` (Arm) lines."""
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def _torch_flags() -> frozenset[str]:
    """The flags torch's CPU probe reports as present; empty where the probe does not exist."""
    import torch

    probe = getattr(torch.cpu, "get_capabilities", None)
    if probe is None:
        return frozenset()
    return frozenset(name for name, value in probe().items() if value is True)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 arithmetic instructions (read once per process)."""
    try:
        flags = cpuinfo_flags(_CPUINFO.read_text())
    except OSError:
        flags = frozenset()
    if not flags:  # not Linux, or a sandbox that hides the file
        flags = _torch_flags()
    return bool(flags & NATIVE_BF16_FLAGS)
