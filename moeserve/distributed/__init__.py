"""Expert and tensor parallelism across processes and machines: the rank processes, their launch,
rendezvous, control channel and monitor.

Node 0's engine drives the ranks through `executor.multiproc.MultiprocessExecutor`; ranks
exchange tokens among themselves with torch.distributed (the `torch` dispatcher, TP
collectives). `run_node` is what other machines run.
"""

from moeserve.distributed.launcher import run_node

__all__ = ["run_node"]
