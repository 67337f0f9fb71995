"""Top-k routing: router logits `[T, E]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32).

One Triton program per token holds the whole row of E <= 1024 logits in registers as a
`[groups, experts per group]` tile, so group-limited selection is a reduction over the tile's
second axis and needs no reshape. The routers of `moeserve.models.layers.router.Router` but
gpt-oss's (`SCORING` picks one at compile time):

* softmax (Mixtral, Qwen, DeepSeek-V2): softmax over all experts in float32; with `num_groups > 1`
  (DeepSeek-V2's group_limited_greedy) only experts of the `topk_groups` groups holding the best
  probabilities stay, the others count as probability 0; the top-k probabilities, optionally
  renormalised, times `routed_scaling_factor`.
* grouped_sigmoid (DeepSeek-V3): sigmoid scores; the float32 correction bias shifts them for
  choosing only; a group scores the sum of its two best biased scores; the top `topk_groups`
  groups stay; the top-k biased scores inside them pick the experts, whose unbiased scores,
  optionally renormalised (+1e-20), times the scale, are the weights.
* sqrtsoftplus (DeepSeek-V4's learned layers): scores sqrt(softplus(logit)), softplus as torch's
  (the logit itself past 20, else log1p(exp(logit))); the correction bias shifts them for
  choosing only; no groups; the chosen experts' unbiased scores, always renormalised (+1e-20),
  times the scale. (Its hash-routed layers choose by a table, not here: `HashRouter`.)

Top-k is K rounds of arg-max over the tile; ties go to the lowest expert id. The K entries of a
row come in descending order of the choosing score, which the MoE result does not depend on.
Everything is computed in float32 whatever the logits' dtype (Triton's interpreter gets bf16
arithmetic wrong, and the router's math is float32 anyway). Shapes alone size the outputs, so a
call is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.config import RouterConfig

MAX_EXPERTS = 1024  # the row lives in one program's registers


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20) in float32: x past 20, else log1p(exp(x)), log1p by
    Goldberg's correction: log(1 + exp(x)) loses exp(x)'s digits as it gets small and is 0 below
    x = -17, where log1p gives exp(x), whose square root still weighs an expert. The exponent is
    capped at 20 so that no lane overflows (a logit past 88 would make inf / inf)."""
    e = tl.exp(tl.minimum(x, 20.0))
    one = 1.0 + e
    grown = one - 1.0  # 0 exactly when e is lost in 1 + e
    log1p = tl.where(grown == 0.0, e, tl.log(one) * (e / tl.where(grown == 0.0, 1.0, grown)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    stride_logits,
    scaling,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    G_PAD: tl.constexpr,
    GS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, G_PAD)[:, None]
    member = tl.arange(0, GS_PAD)[None, :]
    valid = (group < NUM_GROUPS) & (member < GROUP_SIZE)
    expert = group * GROUP_SIZE + member
    x = tl.load(logits_ptr + token * stride_logits + expert, mask=valid, other=0.0).to(tl.float32)

    if SCORING != "softmax":
        if SCORING == "sigmoid":
            scores = tl.sigmoid(x)
        else:
            scores = tl.sqrt(_softplus(x))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
    else:
        x = tl.where(valid, x, float("-inf"))
        row_max = tl.max(tl.max(x, axis=1), axis=0)
        e = tl.where(valid, tl.exp(x - row_max), 0.0)
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
        choice = tl.where(valid, scores, float("-inf"))

    if NUM_GROUPS > 1:
        group_ids = tl.arange(0, G_PAD)
        best = tl.max(choice, axis=1)
        if SCORING == "sigmoid":
            # The sum of the group's two best: drop one occurrence of the best (ties count twice).
            if GROUP_SIZE > 1:
                first = tl.min(tl.where(choice == best[:, None], member, GS_PAD), axis=1)
                second = tl.max(tl.where(member == first[:, None], float("-inf"), choice), axis=1)
                best = best + second
        group_score = tl.where(group_ids < NUM_GROUPS, best, float("-inf"))
        keep = tl.zeros([G_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(tl.where(keep, float("-inf"), group_score), axis=0)
            pick = tl.min(tl.where(~keep & (group_score == top) & (group_ids < NUM_GROUPS), group_ids, G_PAD), axis=0)
            keep = keep | (group_ids == pick)
        # As in the torch router: dropped experts become -inf (sigmoid, choosing only) or
        # probability 0 (softmax, which also weighs with these masked probabilities).
        dropped = valid & ~keep[:, None]
        if SCORING == "sigmoid":
            choice = tl.where(dropped, float("-inf"), choice)
        else:
            choice = tl.where(dropped, 0.0, choice)
            scores = choice

    # Unique keys, real experts before padding lanes, so ties (even among -inf) pick a real expert.
    key = tl.where(valid, expert, NUM_GROUPS * GROUP_SIZE + group * GS_PAD + member)
    taken = tl.zeros([G_PAD, GS_PAD], dtype=tl.int1)
    slot = tl.arange(0, K_PAD)
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    top_weights = tl.zeros([K_PAD], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(tl.where(taken, float("-inf"), choice), axis=1), axis=0)
        candidate = ~taken & (choice == top)
        pick = tl.min(tl.min(tl.where(candidate, key, G_PAD * GS_PAD + NUM_GROUPS * GROUP_SIZE), axis=1), axis=0)
        hit = key == pick
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        taken = taken | hit
        top_ids = tl.where(slot == k, pick.to(tl.int64), top_ids)
        top_weights = tl.where(slot == k, weight, top_weights)

    if RENORMALIZE:
        total = tl.sum(top_weights, axis=0)
        if SCORING != "softmax":
            total = total + 1e-20
        top_weights = top_weights / total
    top_weights = top_weights * scaling
    out = token * TOP_K + slot
    tl.store(ids_ptr + out, top_ids, mask=slot < TOP_K)
    tl.store(weights_ptr + out, top_weights, mask=slot < TOP_K)


def _check_logits(logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if logits.shape[0] and logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride 1 along the experts)")
    num_experts = logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}")


def _launch(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    scoring: str,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    group_size = num_experts // num_groups
    g_pad, gs_pad = triton.next_power_of_2(num_groups), triton.next_power_of_2(group_size)
    _route_kernel[(num_tokens,)](
        logits,
        bias if bias is not None else logits,
        ids,
        weights,
        logits.stride(0),
        float(routed_scaling_factor),
        NUM_GROUPS=num_groups,
        GROUP_SIZE=group_size,
        G_PAD=g_pad,
        GS_PAD=gs_pad,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        TOPK_GROUPS=topk_groups,
        SCORING=scoring,
        HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize,
        num_warps=1 if g_pad * gs_pad <= 256 else 4,
    )
    return ids, weights


def softmax_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Mixtral, Qwen; DeepSeek-V2 group-limited greedy with `num_groups > 1`).

    logits `[T, E]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32).
    """
    _check_logits(logits, top_k, num_groups, topk_groups)
    return _launch(logits, None, top_k, num_groups, topk_groups, "softmax", renormalize, routed_scaling_factor)


def grouped_sigmoid_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: the bias (float32 `[E]`) steers the choice, unbiased scores weigh it.

    logits `[T, E]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32).
    """
    _check_logits(logits, top_k, num_groups, topk_groups)
    _check_bias(logits, correction_bias)
    return _launch(
        logits, correction_bias, top_k, num_groups, topk_groups, "sigmoid", renormalize, routed_scaling_factor
    )


def sqrtsoftplus_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's learned routing: sqrt(softplus) scores, the bias (float32 `[E]`) steers the
    choice, the chosen unbiased scores renormalised (always, as transformers does) weigh it.

    logits `[T, E]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32).
    """
    _check_logits(logits, top_k, 1, 1)
    _check_bias(logits, correction_bias)
    return _launch(logits, correction_bias, top_k, 1, 1, "sqrtsoftplus", True, routed_scaling_factor)


def _check_bias(logits: torch.Tensor, correction_bias: torch.Tensor | None) -> None:
    if correction_bias is None:
        return
    if correction_bias.shape != (logits.shape[1],) or correction_bias.dtype != torch.float32:
        raise ValueError(
            f"correction_bias must be float32 [{logits.shape[1]}], got {correction_bias.dtype} "
            f"{tuple(correction_bias.shape)}"
        )
    if correction_bias.device != logits.device:
        raise ValueError(f"correction_bias is on {correction_bias.device}, logits on {logits.device}")
    if not correction_bias.is_contiguous():
        raise ValueError("correction_bias must be contiguous")


def route(
    router_config: RouterConfig,
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Router.forward`'s math from its logits: the one call the model's GPU path makes.

    logits `[T, E]` (the gate GEMM's output, any float dtype; computed in float32 here);
    `correction_bias` float32 `[E]` exactly when the config has one.
    """
    cfg = router_config
    if cfg.has_correction_bias != (correction_bias is not None):
        raise ValueError(
            f"config has_correction_bias={cfg.has_correction_bias} but correction_bias is "
            f"{'missing' if correction_bias is None else 'given'}"
        )
    if cfg.kind not in ("softmax", "grouped_sigmoid", "sqrtsoftplus"):
        raise ValueError(f"router kind {cfg.kind!r} has no Triton kernel (softmax, grouped_sigmoid, sqrtsoftplus)")
    if cfg.kind == "sqrtsoftplus":
        return sqrtsoftplus_topk(
            logits, cfg.top_k, correction_bias=correction_bias, routed_scaling_factor=cfg.routed_scaling_factor
        )
    if cfg.kind == "grouped_sigmoid":
        return grouped_sigmoid_topk(
            logits,
            cfg.top_k,
            num_groups=cfg.num_groups,
            topk_groups=cfg.topk_groups,
            correction_bias=correction_bias,
            renormalize=cfg.renormalize,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
    if correction_bias is not None:
        raise ValueError("softmax routing takes no correction_bias")
    return softmax_topk(
        logits,
        cfg.top_k,
        renormalize=cfg.renormalize,
        num_groups=cfg.num_groups,
        topk_groups=cfg.topk_groups,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
