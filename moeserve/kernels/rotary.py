"""Rotary position embedding on `[T, heads, D]`, out of place or in place on q and k at once.

Semantics are those of `apply_rotary` in `moeserve/models/layers/rotary.py`, applied to the first
R dims of each head, where cos/sin are `[T, R]`; dims R..D pass through unchanged (partial
rotary). Both layouts:

- half-split (NeoX; Llama, Mixtral, Qwen): `out = x * cos + cat(-x[R/2:], x[:R/2]) * sin`;
- interleaved (GPT-J pairs; DeepSeek `rope_interleave`): pair `(x[2i], x[2i+1])` rotates by
  `cos[i], sin[i]`, and the result is de-interleaved, evens then odds, as the reference writes it.

Rounding follows torch's elementwise ops in the model's dtype: each product `x * cos`, `x * sin`
is rounded to the dtype, then their sum is rounded, so results are bit-identical to the reference.
That needs the launches to turn off floating-point contraction (`enable_fp_fusion=False`): with it
on, Triton lowers the bf16 products to native bf16 multiplies and fuses one of them with the sum
into `fma.rn.bf16`, which skips a rounding torch does.

Inputs may be strided views (MLA rotates `q[..., nope:]`, the last R dims of each head), so the
in-place variant rotates them inside the tensor they belong to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 4096  # elements of one [heads, R] tile a program rotates: bounds the registers held


@triton.jit
def _mul_round(a, b):
    """a * b rounded to a's dtype (as torch's elementwise multiply), carried on in fp32."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    cos_row,
    sin_row,
    token,
    head0,
    num_heads,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cd,
    stride_sd,
    R,
    INTERLEAVED: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the first R dims of heads head0..head0+BLOCK_H of one token (masked to num_heads)."""
    half = R // 2
    heads = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (i < half)[None, :]
    if INTERLEAVED:
        src1, src2 = 2 * i, 2 * i + 1
        cos1 = tl.load(cos_row + i * stride_cd, mask=i < half, other=0.0)
        sin1 = tl.load(sin_row + i * stride_sd, mask=i < half, other=0.0)
        cos2, sin2 = cos1, sin1
    else:
        src1, src2 = i, i + half
        cos1 = tl.load(cos_row + i * stride_cd, mask=i < half, other=0.0)
        sin1 = tl.load(sin_row + i * stride_sd, mask=i < half, other=0.0)
        cos2 = tl.load(cos_row + (i + half) * stride_cd, mask=i < half, other=0.0)
        sin2 = tl.load(sin_row + (i + half) * stride_sd, mask=i < half, other=0.0)
    x_head = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(x_head + src1[None, :] * stride_xd, mask=mask, other=0.0)
    x2 = tl.load(x_head + src2[None, :] * stride_xd, mask=mask, other=0.0)
    out1 = _mul_round(x1, cos1[None, :]) - _mul_round(x2, sin1[None, :])
    out2 = _mul_round(x2, cos2[None, :]) + _mul_round(x1, sin2[None, :])
    if IN_PLACE:
        # A thread may store over elements another thread loaded (always so when interleaved):
        # every load of the program must be done before any store.
        tl.debug_barrier()
    out_head = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(out_head + i[None, :] * stride_od, out1.to(x1.dtype), mask=mask)
    tl.store(out_head + (i + half)[None, :] * stride_od, out2.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    R,
    D,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    _rotate_heads(
        x_ptr,
        out_ptr,
        cos_ptr + token * stride_ct,
        sin_ptr + token * stride_st,
        token,
        head0,
        num_heads,
        stride_xt,
        stride_xh,
        stride_xd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_cd,
        stride_sd,
        R,
        INTERLEAVED,
        False,
        BLOCK_H,
        BLOCK_HALF,
    )
    if COPY_TAIL:  # dims R..D pass through
        heads = head0 + tl.arange(0, BLOCK_H)
        j = R + tl.arange(0, BLOCK_TAIL)
        mask = (heads < num_heads)[:, None] & (j < D)[None, :]
        tail = tl.load(x_ptr + token * stride_xt + heads[:, None] * stride_xh + j[None, :] * stride_xd, mask=mask)
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + j[None, :] * stride_od, tail, mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    num_k_heads,
    q_blocks,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    R,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Head blocks 0..q_blocks-1 of axis 1 rotate q, the rest rotate k: one launch for both."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    if block < q_blocks:
        _rotate_heads(
            q_ptr,
            q_ptr,
            cos_row,
            sin_row,
            token,
            block * BLOCK_H,
            num_q_heads,
            stride_qt,
            stride_qh,
            stride_qd,
            stride_qt,
            stride_qh,
            stride_qd,
            stride_cd,
            stride_sd,
            R,
            INTERLEAVED,
            True,
            BLOCK_H,
            BLOCK_HALF,
        )
    else:
        _rotate_heads(
            k_ptr,
            k_ptr,
            cos_row,
            sin_row,
            token,
            (block - q_blocks) * BLOCK_H,
            num_k_heads,
            stride_kt,
            stride_kh,
            stride_kd,
            stride_kt,
            stride_kh,
            stride_kd,
            stride_cd,
            stride_sd,
            R,
            INTERLEAVED,
            True,
            BLOCK_H,
            BLOCK_HALF,
        )


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must both be [tokens, rotary_dim], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    tokens, rotary_dim = cos.shape
    if x.shape[0] != tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens but cos/sin have {tokens}")
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > x.shape[2]:
        raise ValueError(f"rotary_dim must be even, positive and <= {name}'s head_dim {x.shape[2]}, got {rotary_dim}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(
            f"cos/sin dtypes {cos.dtype}/{sin.dtype} must equal {name}'s {x.dtype} (torch would promote the result)"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos/sin are on {cos.device}/{sin.device}, {name} on {x.device}")


def _blocks(rotary_dim: int, max_heads: int) -> tuple[int, int]:
    """(BLOCK_HALF, BLOCK_H): a program rotates as many heads as fit one tile."""
    block_half = triton.next_power_of_2(rotary_dim // 2)
    return block_half, min(triton.next_power_of_2(max_heads), max(1, _TILE // (2 * block_half)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x `[T, H, D]` rotated by cos/sin `[T, R]` (R <= D, even) -> new contiguous `[T, H, D]`.

    The first R dims of each head rotate as `layers.rotary.apply_rotary` would rotate them; dims
    R..D are copied. x may be a strided view; it is not modified.
    """
    _check(x, cos, sin)
    tokens, heads, head_dim = x.shape
    rotary_dim = cos.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_half, block_h = _blocks(rotary_dim, heads)
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x,
        out,
        cos,
        sin,
        heads,
        *x.stride(),
        *out.stride(),
        *cos.stride(),
        *sin.stride(),
        rotary_dim,
        head_dim,
        INTERLEAVED=interleaved,
        COPY_TAIL=head_dim > rotary_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_TAIL=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        num_warps=4,
        enable_fp_fusion=False,  # round each product, as torch does
    )
    return out


def apply_rotary_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotate q `[T, Hq, Dq]` and k `[T, Hk, Dk]` in place, in one launch, by cos/sin `[T, R]`.

    Same rotation as `apply_rotary` (R <= Dq, Dk; dims past R untouched), written back into q
    and k, which may be strided views (e.g. the rope part of MLA's q). q and k must not overlap.
    """
    _check(q, cos, sin, "q")
    _check(k, cos, sin, "k")
    tokens, q_heads, _ = q.shape
    k_heads = k.shape[1]
    if tokens == 0 or q_heads + k_heads == 0:
        return
    rotary_dim = cos.shape[1]
    block_half, block_h = _blocks(rotary_dim, max(q_heads, k_heads))
    q_blocks = triton.cdiv(q_heads, block_h)
    _rotary_qk_kernel[(tokens, q_blocks + triton.cdiv(k_heads, block_h))](
        q,
        k,
        cos,
        sin,
        q_heads,
        k_heads,
        q_blocks,
        *q.stride(),
        *k.stride(),
        *cos.stride(),
        *sin.stride(),
        rotary_dim,
        INTERLEAVED=interleaved,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
        enable_fp_fusion=False,  # round each product, as torch does
    )
