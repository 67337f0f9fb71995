"""Kernel tests run everywhere: on a GPU natively, on CPU through Triton's interpreter (chosen in
the root conftest, before any module imports triton).

The interpreter is exact for fp32 and fp16 but not for bf16 arithmetic, so CPU tests use
fp32/fp16 on small shapes; the `gpu`-marked tests repeat them at real shapes in bf16 on a device.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
