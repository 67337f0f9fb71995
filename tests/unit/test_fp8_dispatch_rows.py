"""FP8 dispatch rows (`dispatch.fp8`): the quantisation against a plain per-group loop, bit for
bit, its error bound, all-zero rows and groups, hidden sizes that 128 does not divide, the wire
row's bytes, and the refusals."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import fp8


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, 128 channels at a time (the last slice whatever remains), in float32."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(x.shape[0], -(-x.shape[1] // 128))
    for t in range(x.shape[0]):
        for g, start in enumerate(range(0, x.shape[1], 128)):
            part = x[t, start : start + 128].float()
            amax = torch.maximum(part.abs().max(), torch.tensor(1e-4))
            scale = amax / 448.0
            q[t, start : start + 128] = (part / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            scales[t, g] = scale
    return q, scales


def rows(num_tokens: int, hidden_size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows whose groups span very different magnitudes, with one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(num_tokens, hidden_size, generator=g)
        * torch.logspace(-3, 2, hidden_size)[torch.randperm(hidden_size, generator=g)]
    )
    x[num_tokens // 2] = 0
    return x.to(dtype)


@pytest.mark.parametrize("hidden_size", [30, 32, 128, 200, 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_equals_a_per_group_loop(hidden_size: int, dtype: torch.dtype) -> None:
    x = rows(9, hidden_size, dtype)
    q, scales = fp8.quantize(x)
    want_q, want_scales = reference_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (9, -(-hidden_size // 128))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert torch.equal(
        fp8.dequantize(q, scales, dtype),
        (want_q.float() * want_scales.repeat_interleave(128, 1)[:, :hidden_size]).to(dtype),
    )


@pytest.mark.parametrize("hidden_size", [32, 200])
def test_round_trip_error_is_within_half_an_e4m3_step(hidden_size: int) -> None:
    """e4m3 keeps 3 mantissa bits: a normal value moves by at most 2^-4 of itself, a subnormal one
    (below 2^-6 in scaled units) by at most half the subnormal spacing, 2^-10 scaled units."""
    x = rows(16, hidden_size, torch.float32, seed=1)
    _, scales = fp8.quantize(x)
    per_channel = scales.repeat_interleave(128, 1)[:, :hidden_size]
    error = (fp8.round_trip(x) - x).abs()
    bound = (x.abs() * 2**-4 + per_channel * 2**-10) * (1 + 1e-6)
    assert (error <= bound).all()
    assert error.max() > 0, "the round trip must actually quantise"
    # every group's largest value lands on +-448 scaled units, so it comes back nearly exactly
    top = x.abs().amax(1)
    assert torch.allclose(fp8.round_trip(x).abs().amax(1), top, rtol=1e-6)


def test_zero_rows_and_groups_stay_zero() -> None:
    x = torch.zeros(3, 200)
    x[1, :128] = torch.linspace(-2, 3, 128)  # row 1: one live group, one all-zero partial group
    q, scales = fp8.quantize(x)
    floor = torch.tensor(1e-4) / 448.0
    assert torch.equal(scales[0], floor.expand(2)) and scales[1, 1] == floor
    assert scales[1, 0] == torch.tensor(3.0) / 448.0
    back = fp8.dequantize(q, scales, torch.bfloat16)
    assert torch.isfinite(back).all()
    assert not back[0].any() and not back[2].any() and not back[1, 128:].any()


def test_partial_group_has_its_own_scale() -> None:
    """H = 200: channels 128-199 are one group, scaled by their own amax, not the first group's."""
    x = torch.full((1, 200), 0.5)
    x[0, 0] = 100.0
    _, scales = fp8.quantize(x)
    assert torch.equal(scales, torch.tensor([[100.0, 0.5]]) / 448.0)
    assert torch.equal(fp8.round_trip(x)[0, 128:], x[0, 128:])  # 0.5 is 448 scaled units: exact


@pytest.mark.parametrize("hidden_size,row_bytes", [(30, 36), (32, 36), (128, 132), (200, 208), (7168, 7392)])
def test_wire_row_layout(hidden_size: int, row_bytes: int) -> None:
    """FP8 bytes, padding to 4, then the scales; pack and unpack are exact inverses."""
    assert fp8.packed_row_bytes(hidden_size) == row_bytes
    x = rows(5, hidden_size, torch.bfloat16, seed=2)
    q, scales = fp8.quantize(x)
    words = fp8.pack(q, scales)
    assert words.dtype == torch.int32 and words.shape == (5, row_bytes // 4)
    raw = words.view(torch.uint8)
    padded = -(-hidden_size // 4) * 4
    assert torch.equal(raw[:, :hidden_size], q.view(torch.uint8))
    assert not raw[:, hidden_size:padded].any()
    assert torch.equal(raw[:, padded:].contiguous().view(torch.float32), scales)
    back_q, back_scales = fp8.unpack(words, hidden_size)
    assert torch.equal(back_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(back_scales, scales)
    assert torch.equal(fp8.decode_rows(fp8.encode_rows(x), hidden_size).dequantize(x.dtype), fp8.round_trip(x))
    assert fp8.encode_rows(x[:0]).shape == (0, row_bytes // 4)  # a rank without tokens
    zero_words = torch.zeros(2, row_bytes // 4, dtype=torch.int32)  # low-latency padding rows
    assert not fp8.decode_rows(zero_words, hidden_size).dequantize(torch.float32).any()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="not torch.int64"):
        fp8.quantize(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[tokens, hidden\]"):
        fp8.quantize(torch.ones(2, 3, 32))
    with pytest.raises(ValueError, match="positive hidden size"):
        fp8.quantize(torch.ones(2, 0))
    with pytest.raises(ValueError, match=r"int32 \[N, 52\]"):
        fp8.unpack(torch.zeros(2, 51, dtype=torch.int32), 200)
