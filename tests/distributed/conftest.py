"""Fixtures of the multi-rank tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """The ranks' thread count for the reference (see `dispatch_cases.run_cases`), restored
    afterwards: CPU GEMMs round differently with another thread count, and the real experts'
    outputs then match exactly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
