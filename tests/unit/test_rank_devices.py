"""Expert-parallel ranks on CUDA each need a GPU of their own: a node with fewer is refused at once,
by a message that names the ways out, before any rank process starts (nothing waits on NCCL).
The GPU count is monkeypatched, so this runs on CPU machines."""

from __future__ import annotations

import pytest
import torch

from moeserve import cli
from moeserve.distributed.messages import WorkerSpec
from moeserve.distributed.worker import rank_device
from moeserve.engine_config import EngineConfig, ParallelConfig, rank_devices_problem


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch sees n CUDA devices; starting a rank process fails the test."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr("moeserve.distributed.launcher.start_ranks", no_ranks)
    return set_count


@pytest.mark.parametrize(
    "device,ep,tp,nnodes,visible,refused",
    [
        ("cuda", 2, 1, 1, 1, True),
        ("cuda:0", 4, 2, 1, 2, True),
        ("cuda", 8, 1, 2, 2, True),  # 4 ranks on each node, 2 GPUs there
        ("cuda", 2, 1, 1, 0, True),
        ("cuda", 2, 1, 1, 2, False),
        ("cuda", 8, 1, 2, 4, False),
        ("cuda", 1, 1, 1, 0, False),  # one process: nothing to share
        ("cpu", 4, 1, 1, 0, False),
    ],
)
def test_rank_devices_problem(device, ep, tp, nnodes, visible, refused):
    parallel = ParallelConfig(ep=ep, tp=tp, nnodes=nnodes, master_port=29500)
    problem = rank_devices_problem(device, parallel, visible)
    assert (problem is not None) == refused
    if refused:
        assert f"--ep {ep} runs {ep // nnodes} rank processes" in problem
        assert f"{visible} {'is' if visible == 1 else 'are'} visible" in problem
        assert "NCCL" in problem and "--device cpu" in problem and "--nnodes" in problem
        assert (f"--ep {visible} here" if visible > 1 else "--ep 1 (one process") in problem


def test_engine_config_refuses_two_ranks_on_one_gpu(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"--ep 2 runs 2 rank processes.*1 is visible"):
        EngineConfig(device="cuda", parallel=ParallelConfig(ep=2))
    with pytest.raises(ValueError, match="two ranks cannot share a GPU"):
        EngineConfig(device="auto", parallel=ParallelConfig(ep=2, a2a_backend="nvshmem"))
    gpus(2)
    assert EngineConfig(device="cuda", parallel=ParallelConfig(ep=2)).device == "cuda"


@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_launch_refuses_before_starting_anything(gpus, caplog, node_rank):
    """Node 0 (the server) and another node (its ranks only) both stop with the message, exit 2."""
    gpus(1)
    argv = ["launch", "--device", "cuda", "--ep", "4", "--nnodes", "2", "--node-rank", node_rank]
    assert cli.main([*argv, "--master-port", "29500"]) == 2
    assert "--ep 4 runs 2 rank processes on this node" in caplog.text


def test_rank_names_a_missing_gpu(gpus):
    gpus(1)
    spec = WorkerSpec("m", torch.float32, "cuda", ParallelConfig(ep=2), 4, 8, (2,), 0)
    with pytest.raises(RuntimeError, match="local rank 1 needs CUDA device 1 but this node shows 1"):
        rank_device(spec, local_rank=1)
