"""A dispatcher for tests that load one EP rank's share of a model and never run it."""

from __future__ import annotations

from moeserve.dispatch import Dispatcher


class LoadOnly(Dispatcher):
    """Stands in for a rank's all-to-all: gives the loader its placement; any step is a test bug."""

    name = "load-only"

    def dispatch(self, hidden, topk_ids, topk_weights):
        raise AssertionError("a load-only model is never run")

    def combine(self, expert_output, handle):
        raise AssertionError("a load-only model is never run")
