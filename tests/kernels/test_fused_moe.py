"""fused_moe against its per-expert torch reference, and the reference against the model's Experts.

CPU: Triton's interpreter, fp32/fp16, small shapes. `gpu`: bf16 at DeepSeek-V3 (per EP=8 rank)
and Qwen3-30B-A3B expert shapes, plus CUDA-graph capture.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeserve.config import GatedActivation
from moeserve.dispatch import DispatchLayout, DispatchOutput
from moeserve.kernels.fused_moe import fused_moe, fused_moe_reference
from moeserve.kernels.launch_config import KERNEL_CONFIGS, SM90_SHARED_MEMORY, block_m_for, config_for, fit_num_stages
from moeserve.models.layers.experts import Experts

ROOT = Path(__file__).resolve().parents[2]
H, I, E, K = 64, 32, 8, 2
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-3)}


@dataclass(frozen=True)
class LocalAlignedPairs:
    """Same fields as moe_align.AlignedPairs, for when that module is not there."""

    sorted_pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor


def _aligned_cls():
    if importlib.util.find_spec("moeserve.kernels.moe_align") is not None:
        from moeserve.kernels import moe_align

        if hasattr(moe_align, "AlignedPairs"):
            return moe_align.AlignedPairs
    return LocalAlignedPairs


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The alignment format, spelled out with Python loops: pairs of expert 0, padded, then 1, ..."""
    num_pairs = topk_ids.numel()
    p_max = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    ids = [num_pairs] * p_max
    experts = [-1] * (p_max // block_m)
    flat = topk_ids.reshape(-1).tolist()
    pos = 0
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        ids[pos : pos + len(pairs)] = pairs
        blocks = -(-len(pairs) // block_m)
        experts[pos // block_m : pos // block_m + blocks] = [e] * blocks
        pos += blocks * block_m
    dev = topk_ids.device
    return _aligned_cls()(
        sorted_pair_ids=torch.tensor(ids, dtype=torch.int32, device=dev),
        block_experts=torch.tensor(experts, dtype=torch.int32, device=dev),
        num_padded=torch.tensor([pos], dtype=torch.int32, device=dev),
    )


def make_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def random_routing(num_tokens: int, num_experts: int, top_k: int, device, seed: int = 0, skew: float = 0.0):
    """topk_ids `[T, top_k]` of distinct experts; `skew` > 0 makes the counts uneven."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g) + skew * torch.linspace(0, 1, num_experts)
    weights = torch.rand(num_tokens * top_k, generator=g)
    return scores.topk(top_k, dim=-1).indices.to(torch.int32).to(device), weights.to(device)


def run_both(hidden, w13, w2, topk_ids, top_k, pair_weights=None, max_programs=None, block_m=None):
    num_experts = w13.shape[0]
    bm = block_m if block_m is not None else block_m_for(hidden.shape[0], top_k, num_experts)
    aligned = align_reference(topk_ids, num_experts, bm)
    got = fused_moe(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    want = fused_moe_reference(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    return got, want


def dense_expected(hidden, w13, w2, topk_ids, pair_weights=None):
    """Row p = expert(topk_ids.flat[p])(hidden[p // K]) in fp32, zero where the id is not local."""
    top_k = topk_ids.shape[1]
    out = torch.zeros(topk_ids.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        if 0 <= e < w13.shape[0]:
            gate, up = F.linear(hidden[p // top_k].float(), w13[e].float()).chunk(2)
            out[p] = F.linear(F.silu(gate) * up, w2[e].float()) * (1.0 if pair_weights is None else pair_weights[p])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(device, dtype, num_tokens, weighted):
    w13, w2 = make_weights(E, H, I, dtype, device)
    topk_ids, weights = random_routing(num_tokens, E, K, device, skew=2.0)
    hidden = torch.randn(num_tokens, H, device=device).to(dtype)
    got, want = run_both(hidden, w13, w2, topk_ids, K, weights if weighted else None)
    assert got.shape == (num_tokens * K, H) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_reference_matches_dense_loop(device):
    """The reference itself: per-pair dense math, including a skipped (non-local) expert id."""
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids, weights = random_routing(9, E, K, device, skew=2.0)
    topk_ids[2, 1] = -1
    topk_ids[4, 0] = E
    hidden = torch.randn(9, H, device=device)
    aligned = align_reference(topk_ids, E, 16)
    torch.testing.assert_close(
        fused_moe_reference(hidden, w13, w2, aligned, K, weights),
        dense_expected(hidden, w13, w2, topk_ids, weights),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("max_programs", [1, 3, None])
def test_persistent_grid(device, max_programs):
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids, weights = random_routing(33, E, K, device, seed=1)
    hidden = torch.randn(33, H, device=device)
    got, want = run_both(hidden, w13, w2, topk_ids, K, weights, max_programs=max_programs)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_all_tokens_on_one_expert_and_empty_experts(device):
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids = torch.full((33, K), 3, dtype=torch.int32, device=device)
    hidden = torch.randn(33, H, device=device)
    got, want = run_both(hidden, w13, w2, topk_ids, K, max_programs=3)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(got, dense_expected(hidden, w13, w2, topk_ids), **TOL[torch.float32])


def test_skipped_pairs_are_zero(device):
    """Ids outside [0, E) (another rank's experts) are skipped: their rows stay zero."""
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids, weights = random_routing(5, E, K, device)
    topk_ids[1, 0] = -1
    topk_ids[3, 1] = E + 2
    hidden = torch.randn(5, H, device=device)
    got, want = run_both(hidden, w13, w2, topk_ids, K, weights)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert not got[2].any() and not got[7].any()
    torch.testing.assert_close(got, dense_expected(hidden, w13, w2, topk_ids, weights), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pre_grouped_rows_top1(device, dtype):
    """After an EP dispatch: rows grouped by local expert, topk_ids = each row's expert, top_k = 1.
    Equals the model's torch Experts on those rows (then weighted)."""
    counts = [3, 0, 7, 1, 0, 0, 12, 2]
    experts = Experts(E, H, I, dtype, device)
    experts.w13.data, experts.w2.data = make_weights(E, H, I, dtype, device, seed=3)
    rows = torch.randn(sum(counts), H, device=device).to(dtype)
    topk_ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), torch.tensor(counts))[:, None].to(device)
    weights = torch.rand(sum(counts), device=device)
    aligned = align_reference(topk_ids, E, block_m_for(sum(counts), 1, E))
    got = fused_moe(rows, experts.w13, experts.w2, aligned, 1, weights, max_programs=3)
    counts_tensor = torch.tensor(counts, device=device)
    grouped = experts.ops.experts(rows, DispatchLayout.EXPERT_MAJOR, counts_tensor, None, experts.w13, experts.w2)
    want = (grouped.float() * weights[:, None]).to(dtype)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)


CLAMPED = [GatedActivation("clamped_silu", limit=1.0), GatedActivation("clamped_swiglu", alpha=1.702, limit=1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", CLAMPED, ids=[a.kind for a in CLAMPED])
def test_clamped_activations_equal_the_torch_experts(device, dtype, activation):
    """DeepSeek-V4's and gpt-oss's clamped activations in the epilogue: the model's torch Experts
    with that activation on the same rows (weights tripled so that the clamp at 1 bites on many
    gate and up values, which the plain SiLU kernel's different result confirms)."""
    counts = [3, 0, 7, 1, 0, 0, 12, 2]
    experts = Experts(E, H, I, dtype, device, activation=activation)
    w13, w2 = make_weights(E, H, I, torch.float32, device, seed=4)
    experts.w13.data, experts.w2.data = (3 * w13).to(dtype), w2.to(dtype)
    rows = torch.randn(sum(counts), H, device=device).to(dtype)
    topk_ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), torch.tensor(counts))[:, None].to(device)
    aligned = align_reference(topk_ids, E, block_m_for(sum(counts), 1, E))
    got = fused_moe(rows, experts.w13, experts.w2, aligned, 1, activation=activation)
    counts_tensor = torch.tensor(counts, device=device)
    want = experts(DispatchOutput(rows, counts_tensor, DispatchLayout.EXPERT_MAJOR, None))
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    plain = fused_moe(rows, experts.w13, experts.w2, aligned, 1)
    assert (plain.float() - got.float()).abs().max().item() > 0.1


def test_gpt_oss_experts_with_biases_equal_the_torch_experts(device):
    """gpt-oss's experts whole: gate/up and down biases around its clamped SwiGLU, the down bias
    inside the pair's weight, as the torch Experts (bias=True) and the combine compute them."""
    counts = [3, 0, 7, 1, 0, 0, 12, 2]
    activation = CLAMPED[1]
    experts = Experts(E, H, I, torch.float32, device, bias=True, activation=activation)
    w13, w2 = make_weights(E, H, I, torch.float32, device, seed=5)
    experts.w13.data, experts.w2.data = 3 * w13, w2
    g = torch.Generator(device="cpu").manual_seed(5)
    experts.b13.data, experts.b2.data = (
        torch.randn(b.shape, generator=g).to(device) for b in (experts.b13, experts.b2)
    )
    rows = torch.randn(sum(counts), H, device=device)
    topk_ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), torch.tensor(counts))[:, None].to(device)
    weights = torch.rand(sum(counts), device=device)
    aligned = align_reference(topk_ids, E, block_m_for(sum(counts), 1, E))
    biases = (experts.b13.data, experts.b2.data)
    got = fused_moe(rows, experts.w13, experts.w2, aligned, 1, weights, activation=activation, biases=biases)
    want = experts(DispatchOutput(rows, torch.tensor(counts, device=device), DispatchLayout.EXPERT_MAJOR, None))
    torch.testing.assert_close(got, want * weights[:, None], **TOL[torch.float32])
    torch.testing.assert_close(
        got, fused_moe_reference(rows, experts.w13, experts.w2, aligned, 1, weights, None, activation, biases)
    )
    unbiased = fused_moe(rows, experts.w13, experts.w2, aligned, 1, weights, activation=activation)
    assert (unbiased - got).abs().max().item() > 0.1


@pytest.mark.parametrize("block_m", sorted({cfg.block_m for _, cfg in KERNEL_CONFIGS}))
@pytest.mark.parametrize("shape", [(64, 32), (80, 48)], ids=["even", "ragged"])
def test_every_config_row(device, block_m, shape):
    """Each table row's tile sizes, on shapes that divide them and shapes that don't (K masks, N wrap)."""
    hidden_size, inter = shape
    w13, w2 = make_weights(E, hidden_size, inter, torch.float32, device, seed=2)
    topk_ids, weights = random_routing(40, E, K, device, seed=2, skew=3.0)
    hidden = torch.randn(40, hidden_size, device=device)
    got, want = run_both(hidden, w13, w2, topk_ids, K, weights, max_programs=3, block_m=block_m)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("top_k", [1, K])
def test_with_moe_align_kernel(device, top_k):
    """End to end from topk_ids with the alignment kernel the model uses."""
    moe_align = pytest.importorskip("moeserve.kernels.moe_align")
    w13, w2 = make_weights(E, H, I, torch.float16, device)
    topk_ids, weights = random_routing(21, E, top_k, device, skew=2.0)
    topk_ids[0, 0] = -1
    hidden = torch.randn(21, H, device=device).half()
    bm = block_m_for(21, top_k, E)
    got = fused_moe(hidden, w13, w2, moe_align.moe_align_block_size(topk_ids, E, bm), top_k, weights, max_programs=3)
    want = fused_moe_reference(hidden, w13, w2, align_reference(topk_ids, E, bm), top_k, weights)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_strided_hidden(device):
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids, _ = random_routing(6, E, K, device)
    hidden = torch.randn(12, 2 * H, device=device)[::2, 5 : 5 + H]
    got, want = run_both(hidden, w13, w2, topk_ids, K)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_config_table():
    """block_m grows with tokens per expert; every row fits sm_90 shared memory (bf16, gate+up tile)."""
    assert block_m_for(1, 8, 32) == 16
    assert block_m_for(64, 8, 32) == 16
    assert block_m_for(4096, 8, 32) == 128
    sizes = [block_m_for(t, 8, 32) for t in (1, 8, 64, 256, 1024, 4096)]
    assert sizes == sorted(sizes)
    assert len({cfg.block_m for _, cfg in KERNEL_CONFIGS}) == len(KERNEL_CONFIGS)
    for _, cfg in KERNEL_CONFIGS:
        smem = cfg.num_stages * (cfg.block_m * cfg.block_k + 2 * cfg.block_n * cfg.block_k) * 2
        assert smem <= SM90_SHARED_MEMORY, cfg
        assert fit_num_stages(cfg, 2, 2, SM90_SHARED_MEMORY) == cfg.num_stages
        fp32_stages = fit_num_stages(cfg, 4, 2, SM90_SHARED_MEMORY)
        assert 1 <= fp32_stages < cfg.num_stages
        assert fp32_stages * (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * 4 <= SM90_SHARED_MEMORY
    assert config_for(0, 8, 32).block_m == 16
    with pytest.raises(ValueError):
        block_m_for(1, 0, 32)


def test_validation(device):
    w13, w2 = make_weights(E, H, I, torch.float32, device)
    topk_ids, weights = random_routing(5, E, K, device)
    hidden = torch.randn(5, H, device=device)
    aligned = align_reference(topk_ids, E, 16)
    with pytest.raises(ValueError, match="slots"):
        fused_moe(hidden[:4], w13, w2, aligned, K)
    with pytest.raises(ValueError, match="no kernel config"):
        fused_moe(hidden, w13, w2, align_reference(topk_ids, E, 8), K)
    with pytest.raises(ValueError, match="share one of"):
        fused_moe(hidden, w13.half(), w2.half(), aligned, K)
    with pytest.raises(ValueError, match="inconsistent"):
        fused_moe(hidden, w13, w2[:, :, :-1], aligned, K)
    with pytest.raises(ValueError, match="pair_weights"):
        fused_moe(hidden, w13, w2, aligned, K, weights.double())
    b13, b2 = torch.zeros(E, 2 * I, device=device), torch.zeros(E, H, device=device)
    with pytest.raises(ValueError, match="biases must be"):
        fused_moe(hidden, w13, w2, aligned, K, biases=(b13, b2[:, :-1]))
    with pytest.raises(ValueError, match="b13 must be"):
        fused_moe(hidden, w13, w2, aligned, K, biases=(b13.half(), b2))
    with pytest.raises(ValueError, match="int32"):
        fused_moe(
            hidden, w13, w2, type(aligned)(aligned.sorted_pair_ids.long(), aligned.block_experts, aligned.num_padded), K
        )
    with pytest.raises(ValueError, match="max_programs"):
        fused_moe(hidden, w13, w2, aligned, K, max_programs=0)


# --- benchmark accounting (the benchmark itself needs a GPU) ---------------------------------


def _load_bench():
    """bench/ is not a package: load bench/moe_kernel.py by path, once."""
    name = "moe_kernel_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "moe_kernel.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_bench_accounting():
    bench = _load_bench()
    shape = bench.MoEShape("tiny", hidden=4, inter=3, num_experts=5, top_k=2)
    topk_ids = torch.tensor([[0, 2], [2, 4], [0, 4]])
    assert bench.moe_flops(shape, num_tokens=3) == 2 * 3 * 2 * (4 * 6 + 3 * 4)
    assert bench.experts_touched(topk_ids, 5) == 3
    assert bench.weight_bytes(shape, topk_ids, elem_bytes=2) == 3 * (6 * 4 + 4 * 3) * 2
    assert bench.weight_bytes(shape, torch.zeros(0, 2, dtype=torch.long), elem_bytes=2) == 0


def test_bench_paths_agree_with_reference():
    """The torch loop and grouped-GEMM paths the benchmark times compute what fused_moe computes."""
    bench = _load_bench()
    w13, w2 = make_weights(E, H, I, torch.float32, "cpu")
    topk_ids, weights = random_routing(11, E, K, "cpu", skew=2.0)
    hidden = torch.randn(11, H)
    want = dense_expected(hidden, w13, w2, topk_ids, weights)
    routing = bench.Routing.build(topk_ids, weights, E)
    torch.testing.assert_close(bench.torch_loop(hidden, w13, w2, routing), want, rtol=1e-5, atol=1e-5)
    if bench.grouped_mm_supported(torch.float32, "cpu"):
        torch.testing.assert_close(bench.torch_grouped(hidden, w13, w2, routing), want, rtol=1e-5, atol=1e-5)


def test_bench_shape_rows(device):
    """The measuring loop on a tiny shape (fp32, a dummy timer): rows, accounting and agreement."""
    bench = _load_bench()
    shape = bench.MoEShape("tiny", hidden=H, inter=I, num_experts=E, top_k=K)
    ceilings = {"gemm_tflops": 1.0, "copy_gbps": 1.0}
    grouped_ok = bench.grouped_mm_supported(torch.float32, device)
    rows = bench.bench_shape(shape, (1, 9), ceilings, lambda fn: 2.0, grouped_ok, device=device, dtype=torch.float32)
    paths = {"fused", "fused+align", "torch_loop"} | ({"torch_grouped_mm"} if grouped_ok else set())
    assert {(r["tokens"], r["path"]) for r in rows} == {(t, p) for t in (1, 9) for p in paths}
    for r in rows:
        assert r["rel_err_vs_torch_loop"] < 1e-5
        assert r["flops"] == bench.moe_flops(shape, r["tokens"]) and r["tflops"] == r["flops"] / 2.0 / 1e6
        assert r["weight_bytes"] == r["experts_touched"] * 3 * H * I * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_bench_exits_2_without_cuda():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "moe_kernel.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert len(proc.stdout.strip().splitlines()) + len(proc.stderr.strip().splitlines()) == 1


# --- GPU: bf16 at real per-rank shapes ---------------------------------------------------------

GPU_SHAPES = {"deepseek_v3_ep8": (7168, 2048, 32, 8), "qwen3_30b_a3b": (2048, 768, 128, 8)}


@functools.lru_cache(maxsize=2)
def gpu_weights(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 expert weights of one model, kept across its parametrizations (GBs each)."""
    hidden_size, inter, num_experts, _ = GPU_SHAPES[model]
    return make_weights(num_experts, hidden_size, inter, torch.bfloat16, "cuda")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_gpu_bf16_real_shapes(model, num_tokens):
    hidden_size, inter, num_experts, top_k = GPU_SHAPES[model]
    w13, w2 = gpu_weights(model)
    topk_ids, weights = random_routing(num_tokens, num_experts, top_k, "cuda", skew=1.0)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda").to(torch.bfloat16)
    got, want = run_both(hidden, w13, w2, topk_ids, top_k, weights)
    assert _rel_err(got, want) < 2e-2
    assert _rel_err(got[: 2 * top_k], dense_expected(hidden[:2], w13, w2, topk_ids[:2], weights)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("max_programs", [1, 8])
def test_gpu_few_programs(max_programs):
    """Leaving SMs free: a small grid still covers every tile."""
    hidden_size, inter, num_experts, top_k = GPU_SHAPES["qwen3_30b_a3b"]
    w13, w2 = gpu_weights("qwen3_30b_a3b")
    topk_ids, weights = random_routing(64, num_experts, top_k, "cuda")
    hidden = torch.randn(64, hidden_size, device="cuda").to(torch.bfloat16)
    got, want = run_both(hidden, w13, w2, topk_ids, top_k, weights, max_programs=max_programs)
    assert _rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_routing():
    """No host sync in alignment or GEMMs: one captured graph replays right for new routing."""
    moe_align = pytest.importorskip("moeserve.kernels.moe_align")
    hidden_size, inter, num_experts, top_k = GPU_SHAPES["qwen3_30b_a3b"]
    num_tokens = 8
    w13, w2 = gpu_weights("qwen3_30b_a3b")
    hidden = torch.randn(num_tokens, hidden_size, device="cuda").to(torch.bfloat16)
    block_m = block_m_for(num_tokens, top_k, num_experts)
    topk_ids, weights = random_routing(num_tokens, num_experts, top_k, "cuda", seed=0)

    def step() -> torch.Tensor:
        return fused_moe(
            hidden, w13, w2, moe_align.moe_align_block_size(topk_ids, num_experts, block_m), top_k, weights
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_ids, new_weights = random_routing(num_tokens, num_experts, top_k, "cuda", seed=1, skew=4.0)
    topk_ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    want = fused_moe_reference(hidden, w13, w2, align_reference(new_ids, num_experts, block_m), top_k, new_weights)
    assert _rel_err(out, want) < 2e-2
