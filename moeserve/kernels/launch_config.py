"""Launch parameters of the GEMM kernels: the fused MoE's tiles by tokens per expert, stage counts
fitted to the GPU's shared memory, and the size of a persistent grid.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

SM90_SHARED_MEMORY = 232448  # bytes a block may opt into on H100/H200; the budget under the interpreter
CPU_PROGRAMS = 4  # the interpreter runs programs one after another: a few still exercise the persistent loop


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters shared by both GEMMs of one `fused_moe` call.

    In the gate/up kernel a tile holds two `[block_m, block_n]` fp32 accumulators (gate and up
    columns n), so its shared-memory and register footprint is that of a 2 * block_n tile.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (largest mean tokens per expert, config), first match wins. block_m is unique per row: it is how
# `fused_moe` finds the config from an alignment. Starting points for bf16 on an H100, to retune with
# bench/moe_kernel.py; in bf16 every row fits sm_90's shared memory at its stage count, and
# `fit_num_stages` trims the stages where a wider dtype or a smaller GPU would not.
KERNEL_CONFIGS: tuple[tuple[float, KernelConfig], ...] = (
    (16, KernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (64, KernelConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=4)),
    (256, KernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
)


def config_for(num_tokens: int, top_k: int, num_experts: int) -> KernelConfig:
    """The config for `num_tokens` rows routed `top_k` ways over `num_experts` (local) experts."""
    if num_tokens < 0 or top_k < 1 or num_experts < 1:
        raise ValueError(
            f"need num_tokens >= 0, top_k >= 1, num_experts >= 1; got {num_tokens}, {top_k}, {num_experts}"
        )
    tokens_per_expert = num_tokens * top_k / num_experts
    return next(cfg for limit, cfg in KERNEL_CONFIGS if tokens_per_expert <= limit)


def block_m_for(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The block size to align `topk_ids [num_tokens, top_k]` with before calling `fused_moe`."""
    return config_for(num_tokens, top_k, num_experts).block_m


def config_for_block_m(block_m: int) -> KernelConfig:
    """The config an alignment of `block_m` was made for."""
    for _, cfg in KERNEL_CONFIGS:
        if cfg.block_m == block_m:
            return cfg
    known = [cfg.block_m for _, cfg in KERNEL_CONFIGS]
    raise ValueError(f"alignment block_m={block_m} has no kernel config (known: {known}); align with block_m_for(...)")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def shared_memory_budget(device_index: int) -> int:
    """Bytes of shared memory one block of a kernel may use on that GPU."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", SM90_SHARED_MEMORY)


def fit_num_stages(cfg: KernelConfig, elem_bytes: int, weight_tiles: int, budget: int) -> int:
    """The config's stage count, lowered until every stage's operand tiles fit `budget` bytes.

    A stage holds one `[block_m, block_k]` activation tile and `weight_tiles` `[block_k, block_n]`
    weight tiles (2 for gate/up, 1 for down). The table is sized for bf16: fp32 needs fewer stages.
    """
    stage_bytes = (cfg.block_m + weight_tiles * cfg.block_n) * cfg.block_k * elem_bytes
    return max(1, min(cfg.num_stages, budget // stage_bytes))


def w8a8_config(cfg: KernelConfig, scale_block_k: int) -> KernelConfig:
    """`cfg` for the fused MoE's FP8 (w8a8) GEMMs, as `fit_num_stages` fits it to a dtype's bytes: a
    K tile must not straddle two scale blocks, and tiles of 64 rows or more take half as many
    columns. Each K tile's scaled partial product is a second fp32 `[block_m, block_n]` tile beside
    every accumulator, which at the bf16 table's width no longer fits the registers: 128 x 128
    gate/up tiles spilled 544 B a thread on sm_90a and 4 KB on sm_100a, 64 x 128 ones 1.8 KB on
    sm_100a (bench/results/kernel_resources.json)."""
    block_n = cfg.block_n // 2 if cfg.block_m >= 64 else cfg.block_n
    return dataclasses.replace(cfg, block_k=min(cfg.block_k, scale_block_k), block_n=block_n)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_comm_sms: dict[int, int] = {}
"""Per GPU (device index): the SMs its communication kernels hold while the GEMMs run (the most
any dispatcher with a comm stream there asked for)."""


def compute_sms(sm_count: int, comm_sms: int) -> int:
    """The SMs left to compute when communication kernels hold `comm_sms` of `sm_count`; a
    ValueError unless both sides get at least one."""
    if not 1 <= comm_sms < sm_count:
        raise ValueError(
            f"num_comm_sms={comm_sms} must be at least 1 and leave the experts' GEMMs at least one of "
            f"the GPU's {sm_count} SMs"
        )
    return sm_count - comm_sms


def reserve_comm_sms(device: torch.device, comm_sms: int) -> None:
    """Keep `comm_sms` SMs of this GPU free of persistent GEMM grids: communication kernels on a
    stream of their own run there. A grid on every SM would hold them all until it drained, and
    the comm kernels, which other ranks spin on, would start only after the GEMM."""
    index = device_index(device)
    compute_sms(_sm_count(index), comm_sms)
    _comm_sms[index] = max(_comm_sms.get(index, 0), comm_sms)


def default_max_programs(device: torch.device) -> int:
    """One program per SM on CUDA, less the SMs reserved for communication (`reserve_comm_sms`);
    a handful under the CPU interpreter."""
    if device.type == "cuda":
        index = device_index(device)
        return _sm_count(index) - _comm_sms.get(index, 0)
    return CPU_PROGRAMS
