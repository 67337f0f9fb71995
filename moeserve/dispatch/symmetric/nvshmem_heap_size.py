"""How large NVSHMEM's symmetric heap must be, decided before NVSHMEM starts.

NVSHMEM reserves its symmetric heap once per process, when it is initialised (PyTorch does that
in the first symmetric-memory allocation), at `NVSHMEM_SYMMETRIC_SIZE` bytes per GPU, 1 GiB by
default; an allocation past it fails. DeepSeek-V3's buffer alone is 924 MiB per rank with bf16
rows (`nvshmem_layout`), so the default does not hold it with room to spare. The size is
therefore computed from the buffers the process will allocate and exported before that first
allocation; a value the user set is kept, and refused if it is too small.

Pure arithmetic on sizes and the variable's text, so CPU tests check it; `nvshmem_heap` applies it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

SYMMETRIC_SIZE_VAR = "NVSHMEM_SYMMETRIC_SIZE"
DEFAULT_HEAP_BYTES = 1 << 30  # NVSHMEM's default for the variable
MIB = 1 << 20
ALLOCATION_GRANULE = 2 * MIB  # each buffer rounded up to this: room for the allocator's alignment
# NVSHMEM's own allocations from the same heap (PyTorch's per-rendezvous signal pad, NVSHMEM's team
# sync arrays) and its allocator's bookkeeping: a margin chosen to cover them, not measured.
NVSHMEM_RESERVE_BYTES = 128 * MIB

_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt].*)?\s*", re.IGNORECASE)


def required_heap_bytes(buffer_nbytes: Sequence[int]) -> int:
    """The heap that holds every buffer in `buffer_nbytes` at once, with the margins above."""
    if any(nbytes < 1 for nbytes in buffer_nbytes):
        raise ValueError(f"buffer sizes must be positive, got {list(buffer_nbytes)}")
    granules = sum(-(-nbytes // ALLOCATION_GRANULE) for nbytes in buffer_nbytes)
    return granules * ALLOCATION_GRANULE + NVSHMEM_RESERVE_BYTES


def parse_heap_size(text: str) -> int:
    """Bytes of an `NVSHMEM_SYMMETRIC_SIZE` value, read as NVSHMEM documents it: a number, maybe
    fractional, then an optional k/m/g/t (powers of 1024, any case); text after it is ignored."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{SYMMETRIC_SIZE_VAR}={text!r} is not a size (a number with an optional k, m, g or t)")
    number, suffix = match.groups()
    return math.ceil(float(number) * (_SUFFIXES[suffix[0].lower()] if suffix else 1))


def heap_size_to_export(required: int, user_value: str | None, free_bytes: int) -> int | None:
    """The value to export in `NVSHMEM_SYMMETRIC_SIZE` for a heap of `required` bytes, or None to
    leave the variable as it is (the user's value, or NVSHMEM's default, is large enough).

    user_value: the variable as set when this runs (None: unset). free_bytes: the GPU's free
    memory, checked only when this chooses the size: a value the user set is NVSHMEM's to reserve.
    Raises ValueError, naming both sizes and the variable, where the heap cannot be that large."""
    need = f"the nvshmem dispatcher needs a symmetric heap of {required} bytes ({required / MIB:.0f} MiB) per GPU"
    if user_value is not None:
        available = parse_heap_size(user_value)
        if available < required:
            raise ValueError(
                f"{need}, but {SYMMETRIC_SIZE_VAR}={user_value} gives {available} bytes ({available / MIB:.0f} MiB): "
                f"raise {SYMMETRIC_SIZE_VAR} to at least {-(-required // MIB)}m, unset it, or use --a2a-backend torch"
            )
        return None
    if required > free_bytes:
        raise ValueError(
            f"{need}, but only {free_bytes} bytes ({free_bytes / MIB:.0f} MiB) are free on it "
            f"({SYMMETRIC_SIZE_VAR} would have to be at least {-(-required // MIB)}m); use --a2a-backend torch "
            "or fewer experts per rank"
        )
    return required if required > DEFAULT_HEAP_BYTES else None
