"""Executors: where the model runs for the engine (this process, or one process per rank)."""

from moeserve.executor.base import Executor
from moeserve.executor.healing import HealReport, RanksLostError, RejoinReport
from moeserve.executor.in_process import InProcessExecutor
from moeserve.executor.registry import create_executor

__all__ = ["Executor", "HealReport", "InProcessExecutor", "RanksLostError", "RejoinReport", "create_executor"]
