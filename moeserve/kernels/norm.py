"""RMSNorm, alone or fused with the residual add that precedes it, one program per row.

Numerics follow `RMSNorm` in `moeserve/models/layers/norm.py` step by step, so that bf16 results
match the torch reference bit for bit wherever the fp32 scale does:

1. (fused only) `residual = x + residual` is computed in fp32 and rounded to the model's dtype,
   exactly as torch's `x + residual` does, and that rounded sum is what gets normalised;
2. the mean of squares is accumulated in fp32 and the row scaled by `rsqrt(mean + eps)` in fp32;
3. the normalised row is rounded to the model's dtype *before* the weight multiply (HF's order),
   and `weight * row` is rounded once more.

The one known difference is in the fp32 scale `rsqrt(mean + eps)`: the sum of squares is a tree
sum here (contracted into FMAs on a GPU) against torch's own reduction order, and on a GPU the
divide by H and the `rsqrt` are the hardware's approximate ones. The scale can differ from torch's
in its last bits, which moves a bf16 output by one ulp where it lies next to a rounding boundary
(rarely: the tests require over 99% of elements bit-identical).

Rows of up to `MAX_BLOCK` elements live in registers between the read and the write, so each
input is read once. Wider rows are walked in chunks twice (sum of squares, then scale); the
fused kernel's second pass reads back the residual it wrote rather than the inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # widest row held in registers: every hidden size of the supported models fits


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    H,
    eps,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    res_out_row = res_out_ptr + row * stride_res_out
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if ADD_RESIDUAL:
            # Rounded to the model's dtype first, as torch's `x + residual` would be.
            x = (x.to(tl.float32) + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(res_out_row + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
        normed = (x32 * inv_rms).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_row + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)
    else:
        # Pass 1: sum of squares (and, fused, the new residual, which pass 2 reads back).
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            offs = chunk * BLOCK + cols
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if ADD_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
                tl.store(res_out_row + offs, x, mask=mask)
            x32 = x.to(tl.float32)
            acc += x32 * x32
        inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        tl.debug_barrier()  # pass 1's residual stores before pass 2 reads them back
        src_row = res_out_row if ADD_RESIDUAL else x_row
        for chunk in range(NUM_CHUNKS):
            offs = chunk * BLOCK + cols
            mask = offs < H
            x = tl.load(src_row + offs, mask=mask, other=0.0)
            normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
            tl.store(out_row + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim to normalise over, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x's {x.dtype} (torch would promote the result)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} must equal x's {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[..., H]` -> `[N, H]` with a unit column stride: a view where one exists."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if x.numel() == 0:
        return out, res_out
    x_rows, out_rows = _rows(x), out.view(-1, hidden)
    res_rows = _rows(residual) if residual is not None else x_rows
    res_out_rows = res_out.view(-1, hidden) if res_out is not None else out_rows
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 1
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        res_rows,
        weight.contiguous(),
        out_rows,
        res_out_rows,
        hidden,
        float(eps),
        x_rows.stride(0),
        res_rows.stride(0),
        out_rows.stride(0),
        res_out_rows.stride(0),
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(hidden, block),
        num_warps=num_warps,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x `[..., H]` over its last dim, scaled by weight `[H]` -> new `[..., H]`.

    Leading dims are flattened into rows, so per-head norms (Qwen3's q/k norm on `[T, heads, D]`)
    use the same kernel. Same dtype in and out; see the module docstring for the rounding.
    """
    _check(x, weight)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + residual`, then `(RMSNorm(h), h)`, reading x and residual once.

    A decoder layer adds each sub-layer's output to the residual stream and normalises the sum
    for the next sub-layer; fusing saves writing h and reading it back. `h` is bit-identical to
    torch's `x + residual` in the same dtype. Neither input is modified.
    """
    _check(x, weight, residual)
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
