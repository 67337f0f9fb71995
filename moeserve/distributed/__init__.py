"""Expert and tensor parallelism across processes and machines.

Node 0's engine drives one process per rank (`MultiprocessExecutor`) over a control channel;
ranks exchange tokens among themselves with torch.distributed (the `torch` dispatcher, TP
collectives). `run_node` is what other machines run.
"""

from moeserve.distributed.executor import MultiprocessExecutor, WorkerLostError
from moeserve.distributed.launcher import run_node

__all__ = ["MultiprocessExecutor", "WorkerLostError", "run_node"]
