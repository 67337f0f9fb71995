"""Per-token-group FP8 quantization of activations: the activation half of a block-scaled w8a8 GEMM.

Each row of x `[T, K]` is cut into groups of `group` columns (the weights' K tile: 128 for
DeepSeek-V3; the last group may be partial). A group's values are divided by
`scale = max(amax, AMAX_FLOOR) / 448` and rounded to float8_e4m3fn, so its largest magnitude maps
to e4m3's largest value, as DeepSeek-V3's `act_quant` does; the GEMM multiplies each group's
partial products back by `scale`. The floor only keeps an all-zero group from dividing 0 by 0.

The kernel equals `per_token_group_quant_reference` bit for bit, on a GPU and under Triton's
interpreter alike:
* both divisions are `div_rn` (IEEE round to nearest), not the approximate division Triton emits
  for `/` on NVIDIA GPUs;
* the kernel rounds to the e4m3 grid itself, in fp32 (nearest, ties to even), so the cast to
  float8 only changes the storage. The interpreter's own fp32 -> fp8 conversion is wrong when
  the rounding carries into the exponent (31.75 becomes 16) and truncates subnormals, but it is
  exact for values already on the grid, as the GPU's conversion is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.fp8_format import FP8_DTYPE, FP8_MAX
from moeserve.kernels.targets import require_launchable

AMAX_FLOOR = 1e-10
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ELEMENTS_PER_PROGRAM = 4096  # rows per program = this / group: a few KiB of activations each


def group_problem(group: int) -> str | None:
    """Why the Triton w8a8 kernels cannot take FP8 tiles `group` wide along K, or None. The K tile
    doubles as the activations' group: a power of two (a Triton block) of at least 16 (the
    smallest K of a tensor-core dot)."""
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        return f"the Triton w8a8 kernels need an FP8 block size along K that is a power of two >= 16, got {group}"
    return None


def check_group(group: int) -> None:
    problem = group_problem(group)
    if problem is not None:
        raise ValueError(problem)


@triton.jit
def round_to_e4m3(y):
    """fp32 `y` with |y| <= 448 -> the nearest float8_e4m3fn value (ties to even), still fp32."""
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    mag = tl.abs(y)
    bits = mag.to(tl.uint32, bitcast=True)
    # Normal e4m3 (>= 2^-6): keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9. Next to 2^14 fp32's own step is 2^-9, so the add rounds.
    subnormal = (mag + 16384.0) - 16384.0
    rounded = tl.where(mag < 0.015625, subnormal, normal)
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_rows_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS_ON_DEVICE: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """Rows [pid_t * BLOCK_T, +BLOCK_T) x group pid_g: q = round(x / scale), scale = amax / 448."""
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)
    if ROWS_ON_DEVICE:
        num_rows = tl.load(num_rows_ptr)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (cols[None, :] < num_cols)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=ok, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    q = round_to_e4m3(y).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=ok)
    tl.store(scale_ptr + rows64 * stride_sm + pid_g, scale, mask=row_ok)


def per_token_group_quant(
    x: torch.Tensor, group: int, num_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` (fp16, bf16 or fp32; any strides) -> (float8_e4m3fn `[T, K]` contiguous,
    float32 scales `[T, ceil(K / group)]`, x ~= q * scale over each group).

    num_rows: None, or an int32 `[1]` tensor on x's device: quantize only that many leading rows and
    leave the rest of both outputs unwritten; a bound known on the device only (the fused MoE's
    live rows), read there, so the launch needs no host sync.
    """
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be a 2-D {ACTIVATION_DTYPES} tensor, got {x.dtype} {tuple(x.shape)}")
    check_group(group)
    if num_rows is not None and (num_rows.dtype != torch.int32 or num_rows.numel() != 1 or num_rows.device != x.device):
        raise ValueError(f"num_rows must be one int32 on {x.device}, got {num_rows.dtype} {tuple(num_rows.shape)}")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError(
            f"FP8 (e4m3) activations need an sm_89+ GPU (Ada, Hopper or newer); {torch.cuda.get_device_name(x.device)} "
            "is older: use kernels=torch for FP8 checkpoints there"
        )
    require_launchable(x, "per_token_group_quant")
    num_tokens, num_cols = x.shape
    q = torch.empty(num_tokens, num_cols, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_tokens, triton.cdiv(num_cols, group), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scales
    block_t = max(1, _ELEMENTS_PER_PROGRAM // group)
    grid = (triton.cdiv(num_tokens, block_t), scales.shape[1])
    _group_quant_kernel[grid](
        x,
        q,
        scales,
        num_rows if num_rows is not None else scales,
        num_tokens,
        num_cols,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        scales.stride(0),
        GROUP=group,
        BLOCK_T=block_t,
        ROWS_ON_DEVICE=num_rows is not None,
        FLOOR=AMAX_FLOOR,
    )
    return q, scales


def per_token_group_quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `per_token_group_quant` (all rows), what the kernel is tested against."""
    num_tokens, num_cols = x.shape
    num_groups = -(-num_cols // group)
    padded = x.new_zeros(num_tokens, num_groups * group, dtype=torch.float32)
    padded[:, :num_cols] = x.float()
    groups = padded.view(num_tokens, num_groups, group)
    scales = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(num_tokens, -1)[:, :num_cols].contiguous(), scales


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 values of per-token-group quantized `q [T, K]` with `scales [T, ceil(K / group)]`."""
    return q.float() * scales.repeat_interleave(group, dim=1)[:, : q.shape[1]]
