"""Kernel tests run everywhere: on a GPU natively, on CPU through Triton's interpreter.

The interpreter must be chosen before triton is first imported, hence here, at collection.
It is exact for fp32 and fp16 but not for bf16 arithmetic, so CPU tests use fp32/fp16 on small
shapes; the `gpu`-marked tests repeat them at real shapes in bf16 on a device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
