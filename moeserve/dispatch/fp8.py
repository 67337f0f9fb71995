"""FP8 dispatch rows: per-token, per-128-channel e4m3 quantisation and its one-row wire format.

With `dispatch_fp8` a dispatcher sends each token as FP8 bytes plus one float32 scale per group
of 128 channels, about half the bytes of a bf16 row (7392 instead of 14336 at H = 7168), as
DeepEP's low-latency mode does; combine still moves the experts' outputs in the activation dtype.

Quantisation (the activation scheme of DeepSeek-V3's inference code and DeepEP's tests), per
token t and group g of channels [128 g, 128 g + 128):

    amax[t, g]  = max(|x[t, group g]|) in float32, floored at AMAX_FLOOR
    scale[t, g] = amax[t, g] / 448                       (448: the largest finite e4m3fn)
    q[t, c]     = e4m3fn(clamp(x[t, c] / scale[t, g], -448, 448))   (round to nearest even)
    dequantised = (float32(q) * scale).to(activation dtype)

The floor keeps an all-zero group from dividing by zero (its q is 0 and it dequantises to 0);
the clamp makes the cast independent of how a device treats values just past 448 (x / scale can
round a hair above it). Every step is elementwise or a per-row reduction with exact results, so
a row quantises to the same bits whichever backend, batch or device does it: that is what keeps
`local`, `torch` and `nvshmem` bit-equal with FP8 on.

Hidden sizes that are not a multiple of 128 (tiny test models use 32-128; DeepEP refuses them)
are served with a partial last group: ceil(H / 128) groups, the last covering the H % 128
remaining channels, its scale from their amax alone.

Wire row (`packed_row_bytes(H)` bytes, a multiple of 4, so `kernels/peer_copy`'s int32-word
copies and gloo carry it as int32 words `[N, W]`):

    bytes [0, H)                 q, one e4m3fn byte per channel
    bytes [H, pad4(H))           zero padding to a 4-byte boundary
    bytes [pad4(H), + 4 * G)     the G float32 scales

An all-zero row (the padding rows of the low-latency modes) unpacks to q = 0, scale = 0 and so
dequantises to zeros, as an unquantised padding row would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # channels per scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # DeepEP's floor: an all-zero group gets scale 1e-4 / 448, not 0
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def num_groups(hidden_size: int) -> int:
    """Scales per token: ceil(H / 128), the last group partial when 128 does not divide H."""
    _check_hidden_size(hidden_size)
    return -(-hidden_size // GROUP)


def packed_row_bytes(hidden_size: int) -> int:
    """Bytes of one wire row: the FP8 bytes padded to 4, then a float32 scale per group."""
    return _fp8_bytes(hidden_size) + 4 * num_groups(hidden_size)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` float32/float16/bfloat16 -> (q `[T, H]` float8_e4m3fn, scales `[T, G]` float32)."""
    if x.dim() != 2:
        raise ValueError(f"FP8 dispatch quantises [tokens, hidden] rows; got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"FP8 dispatch quantises float32, float16 or bfloat16 rows, not {x.dtype}")
    num_tokens, hidden_size = x.shape
    groups = num_groups(hidden_size)
    padded = torch.zeros(num_tokens, groups * GROUP, dtype=torch.float32, device=x.device)
    padded[:, :hidden_size] = x  # zeros past H leave the partial group's amax unchanged
    grouped = padded.view(num_tokens, groups, GROUP)  # [T, G, 128]
    scales = grouped.abs().amax(dim=2).clamp(min=AMAX_FLOOR) / FP8_MAX  # [T, G]
    q = (grouped / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(num_tokens, groups * GROUP)[:, :hidden_size].contiguous(), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q `[N, H]` float8_e4m3fn, scales `[N, G]` float32 -> `[N, H]` in dtype."""
    num_rows, hidden_size = q.shape
    groups = num_groups(hidden_size)
    if scales.shape != (num_rows, groups):
        raise ValueError(f"{num_rows} rows of {hidden_size} channels need scales [{num_rows}, {groups}]")
    per_channel = scales.repeat_interleave(GROUP, dim=1)[:, :hidden_size]  # [N, H]
    return (q.to(torch.float32) * per_channel).to(dtype)


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q `[N, H]`, scales `[N, G]`) -> int32 words `[N, packed_row_bytes(H) / 4]` (module docstring)."""
    num_rows, hidden_size = q.shape
    fp8_bytes = _fp8_bytes(hidden_size)
    rows = torch.zeros(num_rows, packed_row_bytes(hidden_size), dtype=torch.uint8, device=q.device)
    rows[:, :hidden_size] = q.view(torch.uint8)
    rows[:, fp8_bytes:].view(torch.float32).copy_(scales)  # 4-aligned: the byte columns view as floats
    return rows.view(torch.int32)


def unpack(words: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words `[N, W]` -> (q `[N, H]` float8_e4m3fn, scales `[N, G]` float32); inverse of pack."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.shape[1] * 4 != packed_row_bytes(hidden_size):
        raise ValueError(
            f"FP8 rows of hidden size {hidden_size} are int32 [N, {packed_row_bytes(hidden_size) // 4}]; "
            f"got {words.dtype} {tuple(words.shape)}"
        )
    rows = words.contiguous().view(torch.uint8)  # [N, row bytes]
    q = rows[:, :hidden_size].contiguous().view(FP8)
    scales = rows[:, _fp8_bytes(hidden_size) :].contiguous().view(torch.float32)
    return q, scales


@dataclass(frozen=True)
class FP8Rows:
    """Rows as the FP8 dispatch carried them: q `[N, H]` float8_e4m3fn and scales `[N, G]` float32.
    An FP8 expert GEMM that quantizes its input per token and 128 channels the same way takes
    these as they are, instead of quantizing their dequantised values again."""

    q: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scales, dtype)


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[T, H]` -> its wire rows, int32 `[T, W]`: what a dispatcher sends with FP8 on."""
    return pack(*quantize(x))


def decode_rows(words: torch.Tensor, hidden_size: int) -> FP8Rows:
    """Received wire rows int32 `[N, W]` -> the FP8 rows they carry, for the experts."""
    return FP8Rows(*unpack(words, hidden_size))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the experts see of x after an FP8 dispatch, dequantised: `local_rows(x).dequantize`."""
    return local_rows(x).dequantize(x.dtype)


def local_rows(x: torch.Tensor) -> FP8Rows:
    """x `[T, H]` as an FP8 dispatch would deliver it: the `local` backend hands its experts
    exactly this, so one process computes what an EP group computes."""
    return FP8Rows(*quantize(x))


def _fp8_bytes(hidden_size: int) -> int:
    _check_hidden_size(hidden_size)
    return -(-hidden_size // 4) * 4


def _check_hidden_size(hidden_size: int) -> None:
    if hidden_size < 1:
        raise ValueError(f"FP8 dispatch needs a positive hidden size, got {hidden_size}")
