"""Requests, the paged KV block manager and the continuous-batching scheduler (no tensors, no HTTP)."""

from moeserve.scheduler.admission import AdmissionTally, SLORejectedError
from moeserve.scheduler.block_manager import BlockManager
from moeserve.scheduler.config import SchedulerConfig
from moeserve.scheduler.data_parallel import DataParallelScheduler, StepPlan
from moeserve.scheduler.request import Request, RequestStatus
from moeserve.scheduler.scheduler import (
    KvLoad,
    NewRequest,
    QueueFullError,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from moeserve.scheduler.step_time import StepShape, StepTimeModel

__all__ = [
    "AdmissionTally",
    "BlockManager",
    "DataParallelScheduler",
    "KvLoad",
    "NewRequest",
    "QueueFullError",
    "Request",
    "SLORejectedError",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepPlan",
    "StepShape",
    "StepTimeModel",
]
