"""Keep the memory a CPU step frees for the next step, instead of handing it back to the kernel.

A step on CPU allocates and frees much the same buffers every time (activations, each layer's
gathered context, the experts' inputs). glibc's malloc returns the free memory at the top of its
heap to the kernel once more than M_TRIM_THRESHOLD lies there, and both that threshold and
M_MMAP_THRESHOLD move with what the process has freed so far. So whether a step's buffers come
back as memory the process still has, or as fresh pages that each cost a minor fault (a kernel
entry per 4 KiB) when first written, depends on the allocation history: on the 2-core VM the
float32 bench Mixtral took 500-700 faults a decode step in one process and none in another, and
its mean step was 4.5 ms against a 3.5 ms median; the engine core serving 64 streams swung
between 40 and 1,000 faults a step, and its slowest rounds were those.

Fixing the thresholds (which also turns glibc's adjusting of them off) keeps up to
`TRIM_THRESHOLD` of freed memory in the process and serves requests up to `MMAP_THRESHOLD` from
the heap: the process holds on to the peak of its step's working memory, as tcmalloc (which
vLLM's CPU backend preloads) does. Larger buffers still get their own mapping, whose page
faults are small beside the work on that much data. Other C libraries keep their own policy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top that stays in the process: far above any step's working set here."""
TOP_PAD = 64 << 20
"""Extra heap requested with each growth, so a growing context grows the heap in few steps."""
MMAP_THRESHOLD = 32 << 20
"""glibc's largest allowed value on 64-bit (half its arena size); its default starts at 128 KiB."""


@functools.cache
def retain_freed_host_memory() -> bool:
    """Fix glibc malloc's trim and mmap thresholds for this process (once); False where the C
    library is not glibc or refuses a setting."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = {M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_TOP_PAD: TOP_PAD, M_MMAP_THRESHOLD: MMAP_THRESHOLD}
    accepted = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings.items())
    if not accepted:
        logger.warning("glibc refused a malloc setting: freed step memory may go back to the kernel each step")
    return accepted
