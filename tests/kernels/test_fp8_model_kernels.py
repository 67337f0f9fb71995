"""A whole FP8 model on the Triton kernels (w8a8) against the torch path.

The torch path is weight-only (it dequantizes the FP8 weights and keeps activations as they
are); the Triton path also quantizes every FP8 GEMM's input per token group. On these random
tiny models that rounding moves the logits by about 10% (relative norm), enough to change some
greedy tokens, so the tokens of the two paths cannot be compared. What can: the torch path with
that one rounding added (`W8A8ReferenceOps`, built on the kernels' torch references), which the
Triton path must equal up to fp32 summation order.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from moeserve.checkpoints.quantize_fp8 import quantize_checkpoint
from moeserve.dispatch import DispatchLayout
from moeserve.fp8_format import BlockFP8Weight
from moeserve.kernels.fp8_quant import dequantize_groups, per_token_group_quant_reference
from moeserve.models import load_model
from moeserve.ops import attention_batch, create_ops
from moeserve.ops.torch_ops import TorchOps

PROMPTS = [[5, 9, 11, 13, 17], [7], [21, 4, 8, 30, 2, 99, 140]]
# Qwen3-MoE past one 128 block: 2x2 scale grids with partial blocks, gate/up meeting inside one.
QWEN3 = dict(hidden_size=192, moe_intermediate_size=160, num_experts=4, num_experts_per_tok=2, head_dim=32)
CASES = [("deepseek_v3", {}), ("qwen3_moe", QWEN3)]
# fp32 under the interpreter: the kernels and the reference differ in summation order only, about
# 1e-7 relative; a rounding of the activations to a neighbouring e4m3 value would show as ~1e-3.
# On a GPU, fp8 tensor-core sums in another order may flip a few such roundings.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-2}


def fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as the kernels round activations: quantized per token group, dequantized."""
    return dequantize_groups(*per_token_group_quant_reference(x, group), group).to(x.dtype)


class W8A8ReferenceOps(TorchOps):
    """The torch path with w8a8's one difference: each FP8 GEMM's input rounded per token group."""

    def linear(self, x, weight, bias=None):
        if isinstance(weight, BlockFP8Weight):
            x = fake_quant(x.reshape(-1, x.shape[-1]), weight.block[1]).view(x.shape)
        return super().linear(x, weight, bias)

    def experts(self, x, layout, counts, topk_ids, w13, w2, b13=None, b2=None, activation=None, x_fp8=None):
        """Every (token, k) pair by itself (tiny models: gathering each pair's weights is cheap)."""
        assert layout is DispatchLayout.TOKEN_MAJOR and isinstance(w13, BlockFP8Weight)
        group, ids = w13.block[1], topk_ids.reshape(-1)
        rows = fake_quant(x, group).float().repeat_interleave(topk_ids.shape[1], dim=0)  # [T*K, H]
        gate, up = torch.einsum("ph,pnh->pn", rows, w13.dequantize(torch.float32)[ids]).chunk(2, dim=-1)
        act = fake_quant((F.silu(gate) * up).to(x.dtype), group).float()
        return torch.einsum("pi,phi->ph", act, w2.dequantize(torch.float32)[ids]).to(x.dtype)


def prefill_logits(folder, ops, device) -> torch.Tensor:
    """float32 logits of every position of one paged prefill of PROMPTS."""
    model = load_model(folder, torch.float32, device, ops=ops)
    block_size, tables, start = 4, [], 0
    for p in PROMPTS:
        n = -(-len(p) // block_size)
        tables.append(list(range(start, start + n)))
        start += n
    caches = [torch.zeros(model.kv_cache_shape(start, block_size), device=device) for _ in model.layers]
    lengths = [len(p) for p in PROMPTS]
    plan = model.ops.plan_attention(attention_batch(tables, [0] * len(PROMPTS), lengths, block_size, device))
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(sum(PROMPTS, []), device=device), positions, plan, caches))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("arch,overrides", CASES, ids=[a for a, _ in CASES])
def test_fp8_model_on_triton_equals_the_w8a8_reference(make_checkpoint, tmp_path, device, monkeypatch, arch, overrides):
    folder = shutil.copytree(make_checkpoint(arch, 2, **overrides), tmp_path / "fp8")
    quantize_checkpoint(folder, (128, 128))
    weight_only = prefill_logits(folder, TorchOps(), device)
    reference = prefill_logits(folder, W8A8ReferenceOps(), device)
    with monkeypatch.context() as patch:  # the Triton GEMMs read the FP8 bytes, never a dequantized copy
        patch.setattr(BlockFP8Weight, "dequantize", lambda *_: pytest.fail("Triton path dequantized a weight"))
        got = prefill_logits(folder, create_ops("triton", device), device)
    assert rel_err(got, reference) < TOLERANCE[device.type], rel_err(got, reference)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))  # the same greedy token at every position
    # The rounding of activations is what separates the paths, so the check above can tell them apart.
    assert rel_err(weight_only, reference) > 1e-2
