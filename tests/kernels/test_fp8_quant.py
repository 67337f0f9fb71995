"""Per-token-group FP8 quantization: the kernel equals its torch reference bit for bit.

Under Triton's interpreter too: the kernel rounds to the e4m3 grid itself (see `fp8_quant`), so
the interpreter's faulty fp32 -> fp8 conversion never has to round. Loads of float8 and dots on
float8 operands run fine under the interpreter (checked by the GEMM tests beside this one).
"""

from __future__ import annotations

import pytest
import torch

from moeserve.fp8_format import FP8_DTYPE
from moeserve.kernels.fp8_quant import AMAX_FLOOR, per_token_group_quant, per_token_group_quant_reference


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scales), (q_ref, scales_ref) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape and torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_rows_with_a_partial_group(device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(19, 300, generator=g) * torch.logspace(-3, 2, 300)  # groups of very different ranges
    x[4, :128] = 0.0  # an all-zero group: scale AMAX_FLOOR / 448, values 0
    x = x.to(dtype).to(device)
    got = per_token_group_quant(x, 128)
    assert_same(got, per_token_group_quant_reference(x, 128))
    assert got[1].shape == (19, 3) and got[1][4, 0].item() == pytest.approx(AMAX_FLOOR / 448)


def test_every_e4m3_value_its_midpoints_and_their_neighbours(device):
    """Group amax 448 makes the scale exactly 1, so the rounding is seen bare: ties go to even,
    subnormals keep their steps of 2^-9, and a carry into the exponent lands on the next binade."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[~values.isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    big, small = torch.tensor(1e9), torch.tensor(-1e9)
    y = torch.cat([values, mids, torch.nextafter(mids, big), torch.nextafter(mids, small)])
    y = torch.cat([y, y.new_zeros(-len(y) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((y.shape[0], 1), 448.0), y], dim=1).to(device)  # [R, 128]
    q, scales = per_token_group_quant(x, 128)
    assert torch.equal(scales, torch.ones_like(scales))
    assert_same((q, scales), per_token_group_quant_reference(x, 128))


def test_strided_input_and_a_row_bound_on_the_device(device):
    x = torch.randn(12, 96, device=device)[:, 16:80]  # a column slice: row stride 96
    assert_same(per_token_group_quant(x, 32), per_token_group_quant_reference(x, 32))
    q, scales = per_token_group_quant(x, 32, torch.tensor([5], dtype=torch.int32, device=device))
    assert_same((q[:5], scales[:5]), per_token_group_quant_reference(x[:5], 32))


def test_bad_arguments_are_refused(device):
    x = torch.randn(4, 64, device=device)
    for group in (96, 8):
        with pytest.raises(ValueError, match="power of two >= 16"):
            per_token_group_quant(x, group)
    with pytest.raises(ValueError, match="2-D"):
        per_token_group_quant(x.to(torch.int32), 32)


@pytest.mark.gpu
def test_gpu_bf16_at_deepseek_v3_width():
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16) * 3
    assert_same(per_token_group_quant(x, 128), per_token_group_quant_reference(x, 128))
