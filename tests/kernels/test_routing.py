"""Routing kernel vs the model's torch `Router` (the spec), on the same logits.

The Router is fed the logits themselves through an identity gate (hidden = E, weight = I: the
GEMM reproduces x exactly), so its own forward is the oracle. Ids compare as sets per row, weights
after sorting by expert id. Rows whose choice hangs on a near-tie (two candidates, experts or
groups, within 1e-6 in float64) may legitimately differ between two float32 implementations:
they skip the set comparison but still need weights consistent with the ids the kernel chose.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.config import RouterConfig
from moeserve.kernels.routing import grouped_sigmoid_topk, route, softmax_topk
from moeserve.models.layers.router import Router

NEAR_TIE = 1e-6

MIXTRAL = RouterConfig("softmax", top_k=2, renormalize=True)
QWEN2 = RouterConfig("softmax", top_k=4, renormalize=False)
QWEN3 = RouterConfig("softmax", top_k=8, renormalize=True)
DEEPSEEK_V2 = RouterConfig(
    "softmax", top_k=6, renormalize=False, num_groups=8, topk_groups=3, routed_scaling_factor=16.0
)
DEEPSEEK_V3 = RouterConfig(
    "grouped_sigmoid",
    top_k=8,
    renormalize=True,
    num_groups=8,
    topk_groups=4,
    routed_scaling_factor=2.5,
    has_correction_bias=True,
    logits_in_fp32=True,
)
TINY_V3 = RouterConfig(
    "grouped_sigmoid",
    top_k=3,
    renormalize=True,
    num_groups=4,
    topk_groups=2,
    routed_scaling_factor=2.5,
    has_correction_bias=True,
    logits_in_fp32=True,
)
SIGMOID_PLAIN = RouterConfig("grouped_sigmoid", top_k=4, renormalize=False, num_groups=1, topk_groups=1)
SINGLETON_GROUPS = RouterConfig(
    "grouped_sigmoid", top_k=2, renormalize=True, num_groups=8, topk_groups=3, has_correction_bias=True
)
DEEPSEEK_V4 = RouterConfig(
    "sqrtsoftplus", top_k=6, renormalize=True, routed_scaling_factor=1.5, has_correction_bias=True
)
SQRTSOFTPLUS_PLAIN = RouterConfig("sqrtsoftplus", top_k=3, renormalize=True)

# (config, num_experts): E = 60 and 160 (groups of 20) exercise padded tiles.
CPU_CASES = {
    "mixtral": (MIXTRAL, 8),
    "qwen2": (QWEN2, 60),
    "qwen3": (QWEN3, 128),
    "deepseek_v2": (DEEPSEEK_V2, 160),
    "deepseek_v3": (DEEPSEEK_V3, 256),
    "tiny_v3": (TINY_V3, 8),
    "sigmoid_plain": (SIGMOID_PLAIN, 24),
    "singleton_groups": (SINGLETON_GROUPS, 8),
    "deepseek_v4": (DEEPSEEK_V4, 256),
    "sqrtsoftplus_plain": (SQRTSOFTPLUS_PLAIN, 12),
}


def _router(cfg: RouterConfig, num_experts: int, dtype: torch.dtype, device: torch.device, seed: int) -> Router:
    """A Router whose gate is the identity, so Router(x) routes the logits x."""
    router = Router(cfg, hidden=num_experts, num_experts=num_experts, dtype=dtype, device=device)
    router.weight.copy_(torch.eye(num_experts, dtype=router.weight.dtype, device=device))
    if cfg.has_correction_bias:
        gen = torch.Generator().manual_seed(seed + 1)
        router.correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.1)
    return router


def _near_ties(cfg: RouterConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows whose expert or group choice has two candidates within NEAR_TIE (float64)."""
    x = logits.double()
    num_tokens, num_experts = x.shape
    if cfg.kind != "softmax":
        scores = _scores(cfg, x)
        choice = scores + bias.double() if bias is not None else scores
        grouped = choice.view(num_tokens, cfg.num_groups, num_experts // cfg.num_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        dropped = float("-inf")
    else:
        choice = x.softmax(-1)
        grouped = choice.view(num_tokens, cfg.num_groups, num_experts // cfg.num_groups)
        group_score = grouped.amax(-1)
        dropped = 0.0
    near = torch.zeros(num_tokens, dtype=torch.bool)
    if cfg.num_groups > 1:
        ranked = group_score.sort(-1, descending=True).values
        if cfg.topk_groups < cfg.num_groups:
            near |= (ranked[:, cfg.topk_groups - 1] - ranked[:, cfg.topk_groups]) < NEAR_TIE
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(cfg.topk_groups, -1).indices, True
        )
        choice = choice.masked_fill(~kept.repeat_interleave(num_experts // cfg.num_groups, dim=1), dropped)
    if cfg.top_k < num_experts:
        ranked = choice.sort(-1, descending=True).values
        near |= (ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k]).nan_to_num(nan=0.0) < NEAR_TIE
    return near


def _scores(cfg: RouterConfig, x: torch.Tensor) -> torch.Tensor:
    """The Router's scores of logits `x` (float64)."""
    if cfg.kind == "grouped_sigmoid":
        return x.sigmoid()
    if cfg.kind == "sqrtsoftplus":
        return torch.nn.functional.softplus(x).sqrt()
    return x.softmax(-1)


def _weights_for(cfg: RouterConfig, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The weights the Router's math gives a row for the chosen `ids` (float64)."""
    w = _scores(cfg, logits.double()).gather(1, ids)
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + (0.0 if cfg.kind == "softmax" else 1e-20))
    return w * cfg.routed_scaling_factor


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(-1)
    return ids, weights.gather(1, order)


def _logits(num_tokens: int, num_experts: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Normal logits in float32; in 16-bit types, where random values often round to exact ties,
    each row is a random permutation of distinct values (-E/2 .. E/2 - 1) / 32, exact for E <= 256."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return (torch.randn(num_tokens, num_experts, generator=gen) * 2.0).to(device)
    ranks = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)
    return ((ranks - num_experts // 2) / 32.0).to(dtype).to(device)


def _check_against_router(
    cfg: RouterConfig, num_experts: int, num_tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> None:
    logits = _logits(num_tokens, num_experts, dtype, device, seed)
    router = _router(cfg, num_experts, dtype, device, seed)
    bias = router.correction_bias.detach() if cfg.has_correction_bias else None
    ref_ids, ref_weights = router(logits)
    ids, weights = route(cfg, logits, bias)

    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (num_tokens, cfg.top_k)
    ids, weights = _by_id(ids.cpu(), weights.cpu())
    ref_ids, ref_weights = _by_id(ref_ids.cpu(), ref_weights.cpu().float())
    assert ((ids >= 0) & (ids < num_experts)).all()
    assert (ids[:, 1:] != ids[:, :-1]).all(), "an expert chosen twice"

    cpu_logits, cpu_bias = logits.cpu().float(), None if bias is None else bias.cpu()
    near = _near_ties(cfg, cpu_logits, cpu_bias)
    assert near.sum() <= 0.05 * num_tokens, "too many near-ties for a meaningful comparison"
    torch.testing.assert_close(ids[~near], ref_ids[~near], rtol=0, atol=0)
    torch.testing.assert_close(weights[~near], ref_weights[~near], rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.double(), _weights_for(cfg, cpu_logits, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_route_matches_router(name: str, dtype: torch.dtype, device: torch.device) -> None:
    cfg, num_experts = CPU_CASES[name]
    _check_against_router(cfg, num_experts, num_tokens=9, dtype=dtype, device=device, seed=len(name))


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_route_tiny_batches(num_tokens: int, device: torch.device) -> None:
    _check_against_router(DEEPSEEK_V3, 256, num_tokens, torch.float32, device)
    _check_against_router(MIXTRAL, 8, num_tokens, torch.float32, device)


def test_bias_steers_choice_but_not_weights(device: torch.device) -> None:
    """A large bias on expert 5 makes it chosen everywhere, weighted by its unbiased score."""
    logits = _logits(6, 8, torch.float32, device, seed=3)
    bias = torch.zeros(8, device=device)
    bias[5] = 10.0
    ids, weights = grouped_sigmoid_topk(logits, 1, num_groups=1, topk_groups=1, correction_bias=bias, renormalize=False)
    assert (ids.cpu() == 5).all()
    torch.testing.assert_close(weights.cpu()[:, 0], logits.cpu()[:, 5].sigmoid(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("low,high", [(-30.0, -18.0), (15.0, 120.0)], ids=["log1p", "threshold"])
def test_sqrtsoftplus_tails(low: float, high: float, device: torch.device) -> None:
    """Logits where softplus is exp(x) (log(1 + exp(x)) would give 0 and every weight 0) and
    where it passes 20 and becomes x itself (past 88 exp(x) overflows): the weights of torch's
    softplus."""
    logits = torch.linspace(low, high, 40).view(4, 10)[
        :, torch.randperm(10, generator=torch.Generator().manual_seed(5))
    ]
    ids, weights = route(SQRTSOFTPLUS_PLAIN, logits.to(device))
    want = torch.nn.functional.softplus(logits).sqrt().topk(3, dim=-1)
    assert ids.cpu().tolist() == want.indices.tolist()
    torch.testing.assert_close(weights.cpu(), want.values / want.values.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_ties_pick_lowest_expert(device: torch.device) -> None:
    logits = torch.zeros(2, 16, device=device)
    ids, weights = softmax_topk(logits, 3, renormalize=True)
    assert ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3), rtol=0, atol=1e-6)


def test_strided_rows(device: torch.device) -> None:
    """Rows need not be adjacent: a column slice of a wider tensor routes like a copy of it."""
    wide = _logits(5, 40, torch.float32, device, seed=4)
    view = wide[:, 8:32]
    for got, want in zip(softmax_topk(view, 3, renormalize=True), softmax_topk(view.contiguous(), 3, renormalize=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_validation(device: torch.device) -> None:
    logits = torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        softmax_topk(logits[0], 2, renormalize=True)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        softmax_topk(logits.long(), 2, renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(logits, 9, renormalize=True)
    with pytest.raises(ValueError, match="num_groups"):
        softmax_topk(logits, 2, renormalize=True, num_groups=3)
    with pytest.raises(ValueError, match="topk_groups"):
        grouped_sigmoid_topk(logits, 2, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="contiguous"):
        softmax_topk(logits.t(), 2, renormalize=True)
    with pytest.raises(ValueError, match="correction_bias must be float32"):
        grouped_sigmoid_topk(
            logits, 2, num_groups=4, topk_groups=2, correction_bias=torch.zeros(8, dtype=torch.float16, device=device)
        )
    with pytest.raises(ValueError, match="missing"):
        route(TINY_V3, logits)
    with pytest.raises(ValueError, match="given"):
        route(MIXTRAL, logits, torch.zeros(8, device=device))


GPU_CASES = {
    "deepseek_v3": (DEEPSEEK_V3, 256),
    "deepseek_v4": (DEEPSEEK_V4, 256),
    "qwen3": (QWEN3, 128),
    "mixtral": (MIXTRAL, 8),
    "deepseek_v2": (DEEPSEEK_V2, 160),
}


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_route_matches_router_gpu(name: str, num_tokens: int, device: torch.device) -> None:
    cfg, num_experts = GPU_CASES[name]
    _check_against_router(cfg, num_experts, num_tokens, torch.bfloat16, device, seed=num_tokens)
    _check_against_router(cfg, num_experts, num_tokens, torch.float32, device, seed=num_tokens + 1)


@pytest.mark.gpu
def test_route_cuda_graph(device: torch.device) -> None:
    """No host sync: a captured call replays on new logits written into the same buffer."""
    logits = _logits(64, 256, torch.float32, device, seed=0)
    bias = torch.randn(256, device=device) * 0.1
    route(DEEPSEEK_V3, logits, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route(DEEPSEEK_V3, logits, bias)
    logits.copy_(_logits(64, 256, torch.float32, device, seed=1))
    graph.replay()
    want_ids, want_weights = route(DEEPSEEK_V3, logits, bias)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
