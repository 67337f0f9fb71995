"""Dispatcher backends against a plain per-token MoE reference, in one process (ep = 1).

Communicating backends run over a one-rank gloo group here; their multi-rank behaviour is in
tests/distributed/test_torch_dispatcher.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.routing import routing

from moeserve.config import GatedActivation
from moeserve.dispatch import DISPATCHERS, DispatchLayout, DispatchRows, ExpertPlacement, create_dispatcher
from moeserve.models.layers.experts import Experts
from moeserve.ops.grouped_mlp import grouped_mlp, masked_mlp, row_experts

H, I = 16, 24


def reference_moe(x, topk_ids, topk_weights, w13, w2):
    """Token by token, expert by expert: the definition of an MoE layer."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += topk_weights[t, k] * F.linear(F.silu(gate) * up, w2[e])
    return out


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo world of one, so a communicating backend can run its collectives to itself."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("bound", [None, "tight"], ids=["no-bound", "step-bound"])
@pytest.mark.parametrize("backend", sorted(DISPATCHERS))
@pytest.mark.parametrize("kind", ["uniform", "skewed", "one_expert"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(0, 8, 2), (1, 8, 1), (13, 8, 2), (40, 16, 8), (7, 6, 4)])
def test_backend_matches_reference(one_rank_group, backend, kind, num_tokens, num_experts, top_k, bound):
    reason = DISPATCHERS[backend].supports(ExpertPlacement.contiguous(num_experts), torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    g = torch.Generator().manual_seed(num_tokens * 31 + num_experts + top_k)
    x = torch.randn(num_tokens, H, generator=g)
    ids = routing(kind, num_tokens, num_experts, top_k, g)
    weights = torch.rand(num_tokens, top_k, generator=g)
    experts = Experts(num_experts, H, I, torch.float32)
    experts.w13.copy_(torch.randn(num_experts, 2 * I, H, generator=g) * 0.3)
    experts.w2.copy_(torch.randn(num_experts, H, I, generator=g) * 0.3)
    rows = DispatchRows(H, top_k, torch.float32)  # taken by the backends that allocate when built
    dispatcher = create_dispatcher(backend, ExpertPlacement.contiguous(num_experts), rows=rows)

    received = dispatcher.dispatch(x, ids, weights, num_tokens if bound == "tight" else None)
    counts = received.num_tokens_per_expert
    assert counts.dtype == torch.int64 and counts.device == x.device
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    assert received.num_tokens_per_expert_host in (None, tuple(counts.tolist()))
    by_expert = x.index_select(0, torch.argsort(ids.flatten(), stable=True) // top_k)  # [T*K, H]
    if received.layout is DispatchLayout.TOKEN_MAJOR:
        assert received.hidden is x and received.topk_ids is ids
    else:  # grouped by expert, then padding
        assert torch.equal(received.hidden[: num_tokens * top_k], by_expert)
    out = dispatcher.combine(experts(received), received.handle)

    assert out.shape == (num_tokens, H)
    torch.testing.assert_close(out, reference_moe(x, ids, weights, experts.w13, experts.w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mlp_equals_a_loop_over_experts(dtype):
    """The sync-free grouped GEMM gives each expert's rows exactly what a per-expert F.linear
    pair gives (padding rows past the counts aside); the fallback for a torch without
    `grouped_mm` within rounding (its GEMMs see more rows)."""
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, H, generator=g).to(dtype)  # 10 rows, then 2 of padding
    w13 = (torch.randn(4, 2 * I, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(4, H, I, generator=g) * 0.3).to(dtype)
    expected = []
    for e, rows in enumerate(torch.split(x[:10], counts.tolist())):
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        expected.append(F.linear(F.silu(gate) * up, w2[e]))
    expected = torch.cat(expected)
    assert torch.equal(grouped_mlp(x, counts, w13, w2)[:10], expected)
    fallback = masked_mlp(x, counts, w13, w2)
    torch.testing.assert_close(fallback[:10], expected)
    assert not fallback[10:].any()
    assert row_experts(counts, 12).tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 4, 4]


def test_grouped_mlp_with_biases_and_clamped_swiglu():
    """gpt-oss's experts: each row gets its own expert's biases, and the clamped SwiGLU clamps
    the gate above and the up projection both ways before `(up + 1) * g * sigmoid(alpha * g)`."""
    g = torch.Generator().manual_seed(6)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, H, generator=g)  # 10 rows, then 2 of padding
    w13, w2 = torch.randn(4, 2 * I, H, generator=g) * 0.5, torch.randn(4, H, I, generator=g) * 0.3
    b13, b2 = torch.randn(4, 2 * I, generator=g), torch.randn(4, H, generator=g)
    act = GatedActivation("clamped_swiglu", alpha=1.702, limit=1.0)
    expected, clamped = [], 0
    for e, rows in enumerate(torch.split(x[:10], counts.tolist())):
        gate, up = (rows @ w13[e].T + b13[e]).chunk(2, dim=-1)
        clamped += int((gate > 1.0).sum() + (up.abs() > 1.0).sum())
        gate, up = gate.clamp(max=1.0), up.clamp(-1.0, 1.0)
        expected.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w2[e].T + b2[e])
    assert clamped > 0  # the clamps are met
    expected = torch.cat(expected)
    torch.testing.assert_close(grouped_mlp(x, counts, w13, w2, b13, b2, act)[:10], expected)
    torch.testing.assert_close(masked_mlp(x, counts, w13, w2, b13, b2, act)[:10], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,width", [(64, 28), (60, 32), (62, 30)])
def test_grouped_mlp_takes_widths_grouped_mm_cannot_stride(dtype, hidden, width):
    """Rows of 28 bf16 values (56 bytes), of a hidden size of 60 or 62: what `grouped_mm` refuses
    unpadded ("strides should be multiple of 16 bytes"). Each expert's rows still get a per-expert
    F.linear pair's values, biases and the clamped SwiGLU included, within a rounding of the
    dtype (the padded GEMMs may sum in another order)."""
    g = torch.Generator().manual_seed(7)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, hidden, generator=g).to(dtype)
    w13 = (torch.randn(4, 2 * width, hidden, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(4, hidden, width, generator=g) * 0.3).to(dtype)
    b13, b2 = torch.randn(4, 2 * width, generator=g).to(dtype), torch.randn(4, hidden, generator=g).to(dtype)
    act = GatedActivation("clamped_swiglu", alpha=1.702, limit=1.0)
    plain, biased = [], []
    for e, rows in enumerate(torch.split(x[:10], counts.tolist())):
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        plain.append(F.linear(F.silu(gate) * up, w2[e]))
        gate, up = (F.linear(rows, w13[e]) + b13[e]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=1.0), up.clamp(-1.0, 1.0)
        biased.append(F.linear((up + 1) * (gate * torch.sigmoid(gate * 1.702)), w2[e]) + b2[e])
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    out = grouped_mlp(x, counts, w13, w2)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out[:10], torch.cat(plain), rtol=tol, atol=tol)
    out = grouped_mlp(x, counts, w13, w2, b13, b2, act)
    torch.testing.assert_close(out[:10], torch.cat(biased), rtol=tol, atol=tol)


def test_local_refuses_expert_parallel_layouts():
    with pytest.raises(ValueError, match="ep=2"):
        create_dispatcher("local", ExpertPlacement.contiguous(8, ep_size=2, rank=0))


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown dispatcher 'nope'"):
        create_dispatcher("nope", ExpertPlacement.contiguous(8))


def test_contiguous_placement_spreads_uneven_counts():
    placements = [ExpertPlacement.contiguous(7, ep_size=3, rank=r) for r in range(3)]
    assert [p.local_experts for p in placements] == [(0, 1, 2), (3, 4), (5, 6)]
    with pytest.raises(ValueError):
        ExpertPlacement.contiguous(2, ep_size=4)


@pytest.mark.parametrize("backend", sorted(DISPATCHERS))
def test_fp8_dispatch_hands_the_experts_dequantised_rows(one_rank_group, backend):
    """With `dispatch_fp8` every backend's experts get `fp8.round_trip` of the tokens (bf16 rows,
    H = 200: two groups, the second partial), bit for bit, and the FP8 rows those came from;
    combine stays in bf16."""
    from moeserve.dispatch.fp8 import local_rows, round_trip

    g = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, hidden_size = 11, 8, 2, 200
    x = torch.randn(num_tokens, hidden_size, generator=g).to(torch.bfloat16)
    ids = routing("skewed", num_tokens, num_experts, top_k, g)
    weights = torch.rand(num_tokens, top_k, generator=g)
    rows = DispatchRows(hidden_size, top_k, torch.bfloat16)
    dispatcher = create_dispatcher(backend, ExpertPlacement.contiguous(num_experts), rows=rows, dispatch_fp8=True)
    for bound in (None, num_tokens):
        received = dispatcher.dispatch(x, ids, weights, bound)
        sent, sent_rows = round_trip(x), local_rows(x)
        assert received.hidden.dtype == torch.bfloat16 and not torch.equal(sent, x)
        rows = received.fp8_rows
        assert torch.equal(rows.dequantize(torch.bfloat16), received.hidden)
        if received.layout is DispatchLayout.TOKEN_MAJOR:
            assert torch.equal(rows.q.view(torch.uint8), sent_rows.q.view(torch.uint8))
            assert torch.equal(rows.scales, sent_rows.scales)
            assert torch.equal(received.hidden, sent)
            pair_rows = received.hidden.repeat_interleave(top_k, dim=0)  # [T * K, H]
        else:
            pair_rows = received.hidden
            order = torch.argsort(ids.flatten(), stable=True) // top_k
            by_expert = sent.index_select(0, order)
            assert torch.equal(received.hidden[: num_tokens * top_k], by_expert)
            live = num_tokens * top_k
            assert torch.equal(rows.q[:live].view(torch.uint8), sent_rows.q.view(torch.uint8).index_select(0, order))
            assert torch.equal(rows.scales[:live], sent_rows.scales.index_select(0, order))
            assert not received.hidden[num_tokens * top_k :].any()  # padding rows dequantise to zeros
        out = dispatcher.combine(pair_rows * 2, received.handle)  # toy experts: double each row
        weighted = (weights.to(torch.bfloat16)[:, :, None] * (2 * sent)[:, None, :]).sum(1)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, weighted, rtol=1e-2, atol=1e-2)
