"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (three layers of four there).

Per token: projections to q, k (Hk heads of Dk), v and the output gate z (Hv heads of Dv), and
per value head beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias); q, k
and v go through a depthwise causal conv (silu), then the gated delta rule (`ops.gated_delta`),
an RMSNorm gated by silu(z) per value head, and out_proj. Its cache is a state per sequence
(`StateSpec`), not paged KV.

Tensor parallel: a rank holds Hk / tp key heads and the Hv / tp value heads they serve (their
projection rows, conv channels, A_log and dt_bias), out_proj their input columns (row-parallel),
so forward() returns this rank's partial sum, as attention does. Every projection's rows are
named in the checkpoint (`tensor_parallel.Rows`), which also undoes Qwen3-Next's grouping by key
head.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.cache_spec import StateSpec
from moeserve.config import LinearAttentionConfig, ModelConfig
from moeserve.engine_config import dtype_name
from moeserve.models.layers.linear import Linear
from moeserve.models.tensor_parallel import SINGLE, Rows, TensorParallel, mark_rows, row_parallel
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.state_batch import StateStep


def _heads(cfg: LinearAttentionConfig, tp: TensorParallel) -> tuple[range, range]:
    """This rank's key heads and value heads."""
    hk = tp.split(cfg.num_key_heads, "linear_num_key_heads")
    hv = tp.split(cfg.num_value_heads, "linear_num_value_heads")
    return range(tp.rank * hk, (tp.rank + 1) * hk), range(tp.rank * hv, (tp.rank + 1) * hv)


def _span(first: int, heads: range, dim: int) -> list[int]:
    return [first + h * dim + i for h in heads for i in range(dim)]


def checkpoint_rows(cfg: LinearAttentionConfig, tp: TensorParallel) -> dict[str, Rows]:
    """Our projection -> the checkpoint rows it holds on this rank, in our order (q, k, v of the
    rank's heads, head by head; z, b, a of its value heads)."""
    k_heads, v_heads = _heads(cfg, tp)
    dk, dv, ratio = cfg.key_head_dim, cfg.value_head_dim, cfg.num_value_heads // cfg.num_key_heads
    key_dim, value_dim = cfg.num_key_heads * dk, cfg.num_value_heads * dv
    if not cfg.grouped_projections:  # Qwen3.5: in_proj_qkv is every q, then every k, then every v
        qkv = _span(0, k_heads, dk) + _span(key_dim, k_heads, dk) + _span(2 * key_dim, v_heads, dv)
        full = cfg.conv_channels
        return {
            "in_proj_qkv": Rows("linear_attn.in_proj_qkv.weight", tuple(qkv), full),
            "in_proj_z": Rows("linear_attn.in_proj_z.weight", tuple(_span(0, v_heads, dv)), value_dim),
            "in_proj_b": Rows("linear_attn.in_proj_b.weight", tuple(v_heads), cfg.num_value_heads),
            "in_proj_a": Rows("linear_attn.in_proj_a.weight", tuple(v_heads), cfg.num_value_heads),
        }
    # Qwen3-Next: per key head i, rows [q_i (Dk), k_i (Dk), v (ratio * Dv), z (ratio * Dv)], and
    # in_proj_ba per key head [b (ratio), a (ratio)].
    group = 2 * dk + 2 * ratio * dv

    def grouped(offset: int, width: int) -> tuple[int, ...]:
        return tuple(i * group + offset + j for i in k_heads for j in range(width))

    def ba(offset: int) -> tuple[int, ...]:
        return tuple(i * 2 * ratio + offset + j for i in k_heads for j in range(ratio))

    qkvz, full_ba = cfg.num_key_heads * group, 2 * cfg.num_value_heads
    return {
        "in_proj_qkv": Rows(
            "linear_attn.in_proj_qkvz.weight",
            grouped(0, dk) + grouped(dk, dk) + grouped(2 * dk, ratio * dv),
            qkvz,
        ),
        "in_proj_z": Rows("linear_attn.in_proj_qkvz.weight", grouped(2 * dk + ratio * dv, ratio * dv), qkvz),
        "in_proj_b": Rows("linear_attn.in_proj_ba.weight", ba(0), full_ba),
        "in_proj_a": Rows("linear_attn.in_proj_ba.weight", ba(ratio), full_ba),
    }


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        lin = cfg.linear_attention
        assert lin is not None
        k_heads, v_heads = _heads(lin, tp)
        self.num_v_heads, self.head_v_dim = len(v_heads), lin.value_head_dim
        self.head_k_dim = lin.key_head_dim
        self.ops = ops
        h, value_dim = cfg.hidden_size, self.num_v_heads * lin.value_head_dim
        channels = 2 * len(k_heads) * lin.key_head_dim + value_dim
        rows = checkpoint_rows(lin, tp)
        self.in_proj_qkv = Linear(h, channels, False, dtype, device, ops)
        self.in_proj_z = Linear(h, value_dim, False, dtype, device, ops)
        self.in_proj_b = Linear(h, self.num_v_heads, False, dtype, device, ops)
        self.in_proj_a = Linear(h, self.num_v_heads, False, dtype, device, ops)
        for name, tagged in rows.items():
            mark_rows(getattr(self, name).weight, tagged)
        # The conv's channels are q, k, v as in_proj_qkv's output; checkpoint `[C, 1, K]`.
        self.conv1d = nn.Parameter(
            torch.empty(channels, 1, lin.conv_kernel, dtype=dtype, device=device), requires_grad=False
        )
        qkv_rows = checkpoint_rows(dataclasses.replace(lin, grouped_projections=False), tp)["in_proj_qkv"].rows
        mark_rows(self.conv1d, Rows("linear_attn.conv1d.weight", qkv_rows, lin.conv_channels))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype, device=device), requires_grad=False)
        for param, tensor in ((self.dt_bias, "dt_bias"), (self.A_log, "A_log")):
            mark_rows(param, Rows(f"linear_attn.{tensor}", tuple(v_heads), lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, cfg.rms_norm_eps, dtype, device)
        full_value = lin.num_value_heads * lin.value_head_dim
        self.out_proj = row_parallel(
            Linear(value_dim, h, False, dtype, device, ops), v_heads.start * lin.value_head_dim, full_value, tp
        )

    @staticmethod
    def cache_spec(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> StateSpec:
        lin = cfg.linear_attention
        assert lin is not None
        hk = lin.num_key_heads // tp_size
        hv = lin.num_value_heads // tp_size
        channels = 2 * hk * lin.key_head_dim + hv * lin.value_head_dim
        return StateSpec(
            shapes=((channels, lin.conv_kernel - 1), (hv, lin.key_head_dim, lin.value_head_dim)),
            dtypes=(dtype_name(dtype), "float32"),
        )

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]` (this rank's partial sum under TP); reads and writes each
        sequence's state slot."""
        num_tokens = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x)  # [T, Hv * Dv]
        beta = self.in_proj_b(x).sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        head_dims = (self.head_k_dim, self.head_v_dim)
        core = self.ops.gated_delta_net(mixed, g, beta, self.conv1d.squeeze(1), step, head_dims)  # [T, Hv, Dv]
        gated = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(gated.reshape(num_tokens, self.num_v_heads * self.head_v_dim))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then silu(gate), with transformers' casts (the weight
    multiplies in the model's dtype, the gate in float32)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)
