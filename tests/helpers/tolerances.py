"""Per-dtype tolerances for holding a backend to the torch reference, shared by the kernel tests
and the `LayerOps` tests that run the same kernels through a backend."""

from __future__ import annotations

import torch

ELEMENTWISE = {torch.float32: 1e-6, torch.float16: 1e-3}
"""Norms and rotations: a few roundings per element (fp16 results are mostly bit-identical too)."""

ATTENTION = {torch.float32: 1e-5, torch.float16: 2e-3}
"""Attention against an fp32 reference on the same values: fp32 scores and accumulation, the
probabilities rounded to the value dtype once."""
