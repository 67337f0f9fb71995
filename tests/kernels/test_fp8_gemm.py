"""The block-scaled FP8 (w8a8) linear against its torch reference.

The reference quantizes x per token group exactly as the kernel does (bit for bit, see
test_fp8_quant.py), dequantizes both operands and runs one fp32 matmul. The kernel sums each K
tile's FP8 products (exact in fp32) and then scales the tile's sum: the same terms, grouped and
ordered differently, so in fp32 the two agree to about K * 2^-24 of the output's scale; 1e-5 of
the largest output is that bound with a margin. fp16 outputs add their own rounding (2^-11).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.fp8_format import BlockFP8Weight, quantize
from moeserve.kernels.fp8_gemm import w8a8_linear, w8a8_linear_reference

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def fp8_weight(parts: int, rows: int, cols: int, block: tuple[int, int], device, seed: int = 0) -> BlockFP8Weight:
    """`parts` checkpoint tensors `[rows, cols]` fused along rows, each with its own scale grid."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    quantized = [quantize(torch.randn(rows, cols, generator=g) * (p + 1) / cols**0.5, block) for p in range(parts)]
    data = torch.cat([q for q, _ in quantized]).to(device)
    return BlockFP8Weight(data, torch.stack([s for _, s in quantized]).to(device), block)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    bound = TOL[want.dtype] * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= bound


@pytest.mark.parametrize(
    "parts,rows,cols,num_tokens,block,dtype",
    [
        (1, 200, 300, 5, (128, 128), torch.float32),  # partial tiles along rows and K (300 = 2 * 128 + 44)
        (2, 160, 192, 33, (128, 128), torch.float32),  # gate/up parts meeting inside a 128 block
        (1, 96, 64, 3, (64, 32), torch.float16),  # a smaller block: K tiles of 32
    ],
)
def test_matches_reference(device, parts, rows, cols, num_tokens, block, dtype):
    weight = fp8_weight(parts, rows, cols, block, device)
    x = torch.randn(num_tokens, cols, device=device).to(dtype)
    got = w8a8_linear(x, weight)
    assert got.shape == (num_tokens, parts * rows)
    assert_close(got, w8a8_linear_reference(x, weight))


def test_empty_batch_and_bad_arguments(device):
    weight = fp8_weight(1, 64, 64, (128, 128), device)
    assert w8a8_linear(torch.randn(0, 64, device=device), weight).shape == (0, 64)
    with pytest.raises(ValueError, match="need x"):
        w8a8_linear(torch.randn(3, 32, device=device), weight)
    odd = BlockFP8Weight(weight.data, weight.scale_inv[..., :1], (128, 96))
    with pytest.raises(ValueError, match="power of two"):
        w8a8_linear(torch.randn(3, 64, device=device), odd)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_bench_exits_2_without_cuda():
    """bench/fp8_gemm.py (the w8a8 vs bf16 ratios) refuses in one line, with the runbook's status."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_gemm.py")], capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert len(proc.stdout.strip().splitlines()) + len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
@pytest.mark.parametrize("rows,cols", [(1536, 7168), (7168, 16384)])  # DeepSeek-V3's q_a_proj and o_proj
def test_gpu_bf16_at_deepseek_v3_shapes(num_tokens, rows, cols):
    weight = fp8_weight(1, rows, cols, (128, 128), "cuda")
    x = torch.randn(num_tokens, cols, device="cuda", dtype=torch.bfloat16)
    assert_close(w8a8_linear(x, weight), w8a8_linear_reference(x, weight))
