"""Absorbed MLA attention against the expanded formulation of `MLAttention`.

fp32: against the layer's own numbers. `MLAttention.forward` runs on a tiny DeepSeek-V3 config
(the fields of `tests/helpers/hf_configs.py`'s `hf_config("deepseek_v3")`, parsed by moeserve's DeepSeek
architecture) and its attention output is captured at o_proj's input; the kernel path takes the
same layer's queries, kv_b_proj weight and cache.

fp16 (and bf16 on a GPU): against a direct torch implementation of the expanded formulation
(`expanded`, the layer's `_expand` + `causal_attention`), evaluated in fp32 on the very fp16
values the kernel gets: as in test_paged_attention, an fp16 reference is itself too far from the
exact answer for a 2e-3 tolerance to mean anything.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_configs import hf_config

from moeserve.config import MLAConfig, ModelConfig
from moeserve.kernels.mla_attention import mla_decode, mla_latent_attention
from moeserve.kernels.paged_attention import PagedInputs, paged_inputs
from moeserve.models.architectures.deepseek import parse_config
from moeserve.models.layers.mla import MLAttention
from moeserve.models.layers.rotary import RotaryEmbedding
from moeserve.ops.attention import attention_batch, gather_from_cache, write_to_cache
from moeserve.ops.rotary import apply_rotary
from moeserve.ops.torch_attention import TorchAttentionPlan, causal_attention, torch_attention_plan

MIXED = [(0, 7), (5, 3), (13, 1), (30, 40)]  # (start, query length): prompt, mid-sequence chunk, decode, long chunk
DECODE = [(0, 1), (3, 1), (17, 1), (40, 1), (90, 1)]
STEPS = [(MIXED, 512), (DECODE, 512), (DECODE, 16)]  # (sequences, decode_partition); 16: split-KV merges


def tiny_deepseek(**overrides: int) -> ModelConfig:
    """The parity suite's tiny DeepSeek-V3 (its MLA shapes), read as moeserve reads it."""
    raw = {**hf_config("deepseek_v3", **overrides).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    return parse_config(raw)


def make_plan(seqs, block_size: int, gen: torch.Generator, device) -> tuple[int, TorchAttentionPlan, PagedInputs]:
    """(pool size, reference plan, kernel inputs) with block tables scattered over a larger pool."""
    needed = [-(-(start + qlen) // block_size) for start, qlen in seqs]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seqs))]
    starts, qlens = [s for s, _ in seqs], [q for _, q in seqs]
    meta = torch_attention_plan(attention_batch(tables, starts, qlens, block_size, device))
    return num_blocks, meta, paged_inputs(tables, starts, qlens, block_size, device)


def expanded(q_nope, q_rope, cache, weight, meta: TorchAttentionPlan, scale: float, m: MLAConfig) -> torch.Tensor:
    """The reference formulation (`MLAttention._expand` + causal attention) in the inputs' dtype."""
    num_heads = q_nope.shape[1]
    out, start = [], 0
    for qlen, slots in zip(meta.query_lens, meta.context_slots):
        latent, k_rope = gather_from_cache(cache, slots).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = (latent @ weight.T).view(-1, num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, num_heads, -1)), dim=-1)
        q = torch.cat((q_nope[start : start + qlen], q_rope[start : start + qlen]), dim=-1)
        out.append(causal_attention(q, k, v, scale))
        start += qlen
    return torch.cat(out)


def layer_and_kernel(seqs, block_size: int, num_heads: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel path, MLAttention) attention outputs `[T, H, v_head_dim]` for one fp32 step."""
    gen = torch.Generator().manual_seed(0)
    cfg = tiny_deepseek(num_attention_heads=num_heads, num_key_value_heads=num_heads)
    m = cfg.mla
    torch.manual_seed(0)
    layer = MLAttention(cfg, 0, torch.float32)
    num_blocks, meta, inputs = make_plan(seqs, block_size, gen, "cpu")
    cache = torch.full((num_blocks, block_size, m.kv_lora_rank + m.qk_rope_head_dim), float("nan"))
    for (start, _), slots in zip(seqs, meta.context_slots):  # the already cached part of each context
        write_to_cache(cache, torch.randn(start, cache.shape[-1], generator=gen), slots[:start])
    x = torch.randn(inputs.num_tokens, cfg.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(s, s + q) for s, q in seqs])
    cos, sin = RotaryEmbedding(cfg.rope).cos_sin(positions, torch.float32)

    captured = []
    layer.o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    layer(x, cos, sin, cache, meta)  # writes the step's latents, then attends over the expanded context
    want = captured[0].view(len(x), num_heads, m.v_head_dim)

    q_nope, q_rope = layer._queries(x)[0].split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    q_rope = apply_rotary(q_rope, cos, sin, layer.interleaved_rope)
    got = mla_decode(q_nope, q_rope, cache, layer.kv_b_proj.weight, inputs, layer.scale, m, **kwargs)
    return got, want


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seqs, partition", STEPS)
def test_fp32_matches_mla_layer(block_size, seqs, partition):
    got, want = layer_and_kernel(seqs, block_size, 4, decode_partition=partition)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [MIXED, DECODE])
def test_heads_beyond_one_tile(seqs):
    """20 heads: a full 16-head tile and a partly masked one."""
    got, want = layer_and_kernel(seqs, 4, 20, decode_partition=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seqs, partition", STEPS)
def test_fp16_matches_expanded_formulation(block_size, seqs, partition):
    m = tiny_deepseek().mla
    gen = torch.Generator().manual_seed(1)
    num_blocks, meta, inputs = make_plan(seqs, block_size, gen, "cpu")
    cache = torch.full((num_blocks, block_size, m.kv_lora_rank + m.qk_rope_head_dim), float("nan"))
    for slots in meta.context_slots:
        write_to_cache(cache, torch.randn(len(slots), cache.shape[-1], generator=gen), slots)
    weight = torch.randn(4 * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, generator=gen) / m.kv_lora_rank**0.5
    q_nope = torch.randn(inputs.num_tokens, 4, m.qk_nope_head_dim, generator=gen)
    q_rope = torch.randn(inputs.num_tokens, 4, m.qk_rope_head_dim, generator=gen)
    q_nope, q_rope, cache, weight = (t.half() for t in (q_nope, q_rope, cache, weight))
    scale = m.qk_head_dim**-0.5
    got = mla_decode(q_nope, q_rope, cache, weight, inputs, scale, m, decode_partition=partition)
    assert got.dtype == torch.float16
    want = expanded(q_nope.float(), q_rope.float(), cache.float(), weight.float(), meta, scale, m)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_rejects_bad_inputs():
    m = tiny_deepseek().mla
    inputs = paged_inputs([[0]], [0], [2], 4, "cpu")
    q_nope, q_rope = torch.zeros(2, 4, 16), torch.zeros(2, 4, 8)
    cache, weight = torch.zeros(2, 4, 24), torch.zeros(4 * 28, 16)
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        mla_decode(torch.zeros(2, 4, 8), q_rope, cache, weight, inputs, 0.1, m)
    with pytest.raises(ValueError, match="kv_b_proj_weight"):
        mla_decode(q_nope, q_rope, cache, torch.zeros(3 * 28, 16), inputs, 0.1, m)
    with pytest.raises(ValueError, match="kv_lora_rank 16"):
        mla_decode(q_nope, q_rope, torch.zeros(2, 4, 30), weight, inputs, 0.1, m)
    with pytest.raises(ValueError, match="share a dtype"):
        mla_decode(q_nope, q_rope, cache.half(), weight, inputs, 0.1, m)
    with pytest.raises(ValueError, match="add up to 2"):
        mla_decode(q_nope[:1], q_rope[:1], cache, weight, inputs, 0.1, m)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 shapes in bf16: kv_lora 512, rope 64, nope 128, v 128; 128 heads (TP 1) and 16
# (TP 8). Judged against the expanded formulation in fp32 on the same bf16 values: the kernel
# must be no less accurate than that formulation run in bf16.
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_bf16_deepseek_v3_shapes(num_heads, decode, device):
    m = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    gen = torch.Generator().manual_seed(0)
    if decode:
        seqs = [(c - 1, 1) for c in torch.randint(1, 4097, (64,), generator=gen).tolist()]
    else:
        seqs = [(0, 1024), (2000, 256), (300, 1), (4000, 64)]
    num_blocks, meta, inputs = make_plan(seqs, 16, gen, device)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    cache = torch.randn(num_blocks, 16, 576, generator=gen).to(**bf16)
    weight = (torch.randn(num_heads * 256, 512, generator=gen) / 512**0.5).to(**bf16)
    q_nope = torch.randn(inputs.num_tokens, num_heads, 128, generator=gen).to(**bf16)
    q_rope = torch.randn(inputs.num_tokens, num_heads, 64, generator=gen).to(**bf16)
    scale = 192**-0.5
    got = mla_decode(q_nope, q_rope, cache, weight, inputs, scale, m).float()
    truth = expanded(q_nope.float(), q_rope.float(), cache.float(), weight.float(), meta, scale, m)
    bf16_error = (expanded(q_nope, q_rope, cache, weight, meta, scale, m).float() - truth).abs().max().item()
    assert (got - truth).abs().max().item() <= 2 * bf16_error + 1e-3


@pytest.mark.gpu
def test_gpu_latent_attention_fp32_is_exact(device):
    """The latent kernel alone, fp32 with IEEE products, against a dense evaluation."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 16, 576, generator=gen).to(device)
    inputs = paged_inputs([list(range(64))], [1000], [1], 16, device)
    q_latent = torch.randn(1, 16, 512, generator=gen).to(device)
    q_rope = torch.randn(1, 16, 64, generator=gen).to(device)
    got = mla_latent_attention(q_latent, q_rope, cache, inputs, 0.05, 512)
    context = cache.view(-1, 576)[:1001]
    probs = torch.softmax(torch.cat((q_latent, q_rope), dim=-1)[0] @ context.T * 0.05, dim=-1)
    torch.testing.assert_close(got[0], probs @ context[:, :512], atol=2e-5, rtol=2e-5)
