"""FP8 block-quantized checkpoints against transformers running their dequantized weights.

Each case is a checkpoint written by transformers (random weights), rewritten in the layout the
FP8 releases use (float8_e4m3fn weights, a `weight_scale_inv` per 128x128 block, stored float32
as DeepSeek's are or bfloat16/float16 as Qwen3-FP8's are, `quantization_config`; Qwen3-Next's
and Qwen3.5's with what their releases keep unquantized listed in `modules_to_not_convert`, and
Qwen3.5's experts stacked as released). The reference
is transformers, in the case's compute dtype, on a copy whose weights are the FP8 values times
their scales, dequantized here block by block (not by moeserve's code), so moeserve, which keeps
the FP8 bytes and dequantizes at use, must match it as it matches an unquantized checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from helpers.hf_configs import VOCAB
from helpers.load_only import LoadOnly
from helpers.reference import hf_greedy_tokens, hf_model, max_prefill_dlogit
from helpers.stacked_experts import stack_experts
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.checkpoints.quantize_fp8 import quantize_checkpoint
from moeserve.fp8_format import dequantize, quantize
from moeserve.models import fp8 as fp8_module
from moeserve.models import load_model
from moeserve.models.checkpoint import CheckpointError
from moeserve.models.quantized_sources import scale_shard
from moeserve.models.tensor_parallel import Shard

logger = logging.getLogger(__name__)

BLOCK = (128, 128)
PUBLISHED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Qwen3-MoE sized past one block: hidden 192 and experts of 160 give 2x2 scale grids with partial
# blocks, and gate/up parts meeting inside a block of our fused gate_up.
QWEN3 = dict(hidden_size=192, moe_intermediate_size=160, num_experts=8, num_experts_per_tok=2, head_dim=32)
PROMPT_LENGTHS = (1, 9, 26)
# The hybrids, hidden 192 for partial blocks (a DeltaNet's in_proj_qkvz [128, 192], out_proj
# [192, 48]), and prompts of 40 to 200 tokens, as their unquantized parity tests.
HYBRID = dict(hidden_size=192)
HYBRID_PROMPTS = (40, 200)


@dataclass(frozen=True)
class Case:
    """One FP8 checkpoint and the dtype it is run in (by moeserve and by the reference alike)."""

    arch: str
    overrides: dict = field(default_factory=dict)  # HF config fields
    scale_dtype: torch.dtype = torch.float32  # what its `weight_scale_inv` tensors are stored in
    dtype: torch.dtype = torch.float32
    stacked: bool = False  # experts stacked per layer, as Qwen3.5 releases them
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS

    @property
    def max_model_len(self) -> int:
        return max(96, max(self.prompt_lengths) + 32)

    @property
    def max_dlogit(self) -> float:
        """The prefill logit gap allowed: fp32 agrees to rounding; bf16 to a few of its ulps
        (both sides round the same weights, but sum in their own orders)."""
        return 1e-4 if self.dtype == torch.float32 else 0.1


CASES = {
    "deepseek_v3": Case("deepseek_v3"),
    "qwen3_moe": Case("qwen3_moe", QWEN3),
    # DeepSeek-V3.2's layout: the indexer's wq_b and wk FP8, its weights_proj not; contexts of up
    # to 58 tokens past its top 16.
    "deepseek_v32": Case("deepseek_v32"),
    # As Qwen3-1.7B-FP8 and Qwen3-32B-FP8 store their scales.
    "qwen3_moe-bf16_scales": Case("qwen3_moe", QWEN3, scale_dtype=torch.bfloat16),
    # As Qwen3-4B-Instruct-2507-FP8 stores its scales; experts of 28 (56-byte bf16 rows, which
    # grouped_mm cannot stride unpadded) run in bf16.
    "deepseek_v3-width28-fp16_scales-bf16": Case(
        "deepseek_v3", dict(moe_intermediate_size=28), scale_dtype=torch.float16, dtype=torch.bfloat16
    ),
    # Qwen3-Next-FP8 and Qwen3.5's FP8 releases: bf16 scales as Qwen stores them.
    "qwen3_next-bf16_scales": Case("qwen3_next", HYBRID, torch.bfloat16, prompt_lengths=HYBRID_PROMPTS),
    "qwen3_5_moe-stacked-bf16_scales": Case(
        "qwen3_5_moe", HYBRID, torch.bfloat16, stacked=True, prompt_lengths=HYBRID_PROMPTS
    ),
}
EP_ONLY = ("qwen3_5_moe-stacked-bf16_scales",)
"""Cases whose greedy tokens are checked over EP ranks only (CI time): their single-process load
is held to transformers' prefill logits by the layout test."""
EP_CASES = {
    "deepseek_v3": 4,
    "qwen3_moe-bf16_scales": 4,
    "deepseek_v3-width28-fp16_scales-bf16": 4,
    "qwen3_5_moe-stacked-bf16_scales": 2,  # 6 experts: each rank reads its 3 experts' rows of the stacked tensors
}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def reference_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """The published rule, tile by tile: weight.float() * scale_inv of its 128x128 block; a
    stacked expert tensor expert by expert, each of its `parts` (gate, up) on its own grid."""
    if weight.dim() == 3:
        return torch.stack([reference_dequantize(w, s, parts) for w, s in zip(weight, scale_inv)])
    if parts > 1:
        return torch.cat([reference_dequantize(w, s) for w, s in zip(weight.chunk(parts), scale_inv.chunk(parts))])
    out = torch.empty(weight.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = weight[rows, cols].float() * scale_inv[i, j]
    return out


@pytest.fixture(scope="module")
def reference(fp8_pair):
    """case -> (transformers on the dequantized weights, in the case's dtype; its 32 greedy
    tokens per prompt)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            cache[case] = hf_greedy(fp8_pair(case)[1], prompts(CASES[case].prompt_lengths), CASES[case].dtype)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def fp8_pair(make_checkpoint, tmp_path_factory):
    """case -> (FP8 folder, folder of its dequantized weights in fp32)."""
    built = {}

    def get(case: str):
        if case not in built:
            spec = CASES[case]
            base = make_checkpoint(spec.arch, 7, **spec.overrides)
            root = tmp_path_factory.mktemp(f"fp8-{case}")
            if spec.stacked:
                base = stack_experts(base, root / "stacked")
            fp8, plain = shutil.copytree(base, root / "fp8"), shutil.copytree(base, root / "dequantized")
            quantize_checkpoint(fp8, BLOCK, spec.scale_dtype)
            with safe_open(fp8 / "model.safetensors", framework="pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            values = {
                n: reference_dequantize(t, tensors[n + "_scale_inv"], 2 if n.endswith("gate_up_proj") else 1)
                if t.dtype == torch.float8_e4m3fn
                else t
                for n, t in tensors.items()
                if not n.endswith("_scale_inv")
            }
            save_file(values, plain / "model.safetensors", metadata={"format": "pt"})
            built[case] = fp8, plain
        return built[case]

    return get


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(folder, batch: list[list[int]], dtype: torch.dtype):
    model = hf_model(folder, dtype)
    return model, [hf_greedy_tokens(model, p, 32) for p in batch]


def test_checkpoint_has_the_published_layout(fp8_pair):
    fp8, _ = fp8_pair("qwen3_moe")
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == PUBLISHED
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        down = "model.layers.0.mlp.experts.3.down_proj.weight"
        assert f.get_slice(down).get_dtype() == "F8_E4M3" and f.get_slice(down).get_shape() == [192, 160]
        assert f.get_slice(down + "_scale_inv").get_dtype() == "F32"
        assert f.get_slice(down + "_scale_inv").get_shape() == [2, 2]
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
            assert f.get_slice(kept).get_dtype() == "F32" and kept + "_scale_inv" not in f.keys()


def test_hybrid_checkpoints_have_the_released_layout_and_load_as_the_engine_keeps_them(fp8_pair, reference):
    """What Qwen's hybrid FP8 releases keep unquantized stays so and is listed; Qwen3.5's stacked
    experts are FP8 with gate and up on their own grids. Loaded in one process: experts, attention
    and out_proj keep FP8 bytes and scales, the DeltaNet in-projections, whose rows do not fall on
    blocks, are dequantized at load, and the prefill logits are transformers' on the dequantized
    twin (its greedy tokens are checked over two EP ranks)."""
    case = "qwen3_5_moe-stacked-bf16_scales"
    fp8, _ = fp8_pair(case)
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in quant.items() if k != "modules_to_not_convert"} == PUBLISHED
    layer = "model.layers.0"
    kept = [f"{layer}.linear_attn.{m}" for m in ("conv1d", "in_proj_a", "in_proj_b")]
    kept += [f"{layer}.mlp.gate", f"{layer}.mlp.shared_expert_gate", "model.embed_tokens", "lm_head"]
    assert set(kept) <= set(quant["modules_to_not_convert"])
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        for name in kept:
            assert f.get_slice(name + ".weight").get_dtype() == "F32" and name + ".weight_scale_inv" not in f.keys()
        gate_up = f"{layer}.mlp.experts.gate_up_proj"
        assert f.get_slice(gate_up).get_dtype() == "F8_E4M3" and f.get_slice(gate_up).get_shape() == [6, 64, 192]
        assert f.get_slice(gate_up + "_scale_inv").get_shape() == [6, 2, 2]  # 2 parts of 32 rows, 192 columns
        assert f.get_slice(f"{layer}.linear_attn.in_proj_qkv.weight").get_dtype() == "F8_E4M3"
    model = load_model(fp8)
    deltanet, experts = model.layers[0].linear_attn, model.layers[0].mlp.experts
    assert experts.parametrizations.w13[0].scale_inv.shape == (6, 2, 1, 2)
    assert deltanet.out_proj.parametrizations.weight.original.dtype == torch.float8_e4m3fn
    assert model.layers[3].attn.o_proj.parametrizations.weight.original.dtype == torch.float8_e4m3fn
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b"):
        assert getattr(deltanet, name).weight.dtype == torch.float32
    # A heal reads expert 4's rows of the stacked data and scales as the load holds them.
    from moeserve.models.loader import ExpertReader

    reader = ExpertReader(fp8, torch.float32)
    read = reader.read(0, experts, [4])
    reader.close()
    w13 = experts.parametrizations.w13
    assert torch.equal(read["parametrizations.w13.0.scale_inv"][0], w13[0].scale_inv[4])
    assert torch.equal(read["parametrizations.w13.original"][0].view(torch.uint8), w13.original[4].view(torch.uint8))
    dlogit = max_prefill_dlogit(model, reference(case)[0], prompts(CASES[case].prompt_lengths))
    logger.warning("FP8 %s: max |dlogit| vs dequantized transformers %.2e", case, dlogit)
    assert dlogit < CASES[case].max_dlogit


@pytest.mark.parametrize(
    "tensor,config,refusal",
    [
        (
            "model.layers.0.linear_attn.conv1d.weight",
            {"modules_to_not_convert": ["lm_head"]},  # conv1d not listed: refused all the same
            "of a Gated DeltaNet only the projections are read in FP8",
        ),
        (
            "model.layers.0.linear_attn.in_proj_qkvz.weight",
            {"modules_to_not_convert": ["lm_head", "model.layers.0.linear_attn"]},
            "quantization_config.modules_to_not_convert lists its module",
        ),
    ],
)
def test_unsupported_fp8_tensors_of_hybrids_are_refused_by_name(fp8_pair, tmp_path, tensor, config, refusal):
    """An FP8 conv1d (the releases keep it unquantized) and an FP8 tensor of a module the config
    says is not converted are refused, naming the tensor."""
    fp8, _ = fp8_pair("qwen3_next-bf16_scales")
    broken = shutil.copytree(fp8, tmp_path / "broken")
    raw = json.loads((broken / "config.json").read_text())
    raw["quantization_config"].update(config)
    (broken / "config.json").write_text(json.dumps(raw))
    with safe_open(broken / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    if tensors[tensor].dtype != torch.float8_e4m3fn:
        tensors[tensor] = tensors[tensor].to(torch.float8_e4m3fn)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {tensor} is FP8.*{refusal}"):
        load_model(broken)


@pytest.mark.parametrize(
    "case,stored",
    [("qwen3_moe-bf16_scales", "BF16"), ("deepseek_v3-width28-fp16_scales-bf16", "F16")],
)
def test_half_precision_scales_are_held_exactly_in_float32(fp8_pair, case, stored):
    """Scales stored bf16/fp16, as Qwen3-FP8 releases store them, are held in float32 with the
    stored values exactly, by a load and by a heal's read of the same experts alike."""
    from moeserve.models.loader import ExpertReader

    fp8, _ = fp8_pair(case)
    down = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        assert f.get_slice(down).get_dtype() == stored
        expected = f.get_tensor(down)
    model = load_model(fp8, dtype=CASES[case].dtype)
    experts = model.layers[1].mlp.experts
    held = experts.parametrizations.w2[0].scale_inv
    assert held.dtype == torch.float32 and torch.equal(held[3, 0], expected.float())
    assert model.layers[0].attn.o_proj.parametrizations.weight[0].scale_inv.dtype == torch.float32
    reader = ExpertReader(fp8, CASES[case].dtype)
    read = reader.read(model.cfg.moe_layer_indices.index(1), experts, [3])
    reader.close()
    assert read["parametrizations.w2.0.scale_inv"].dtype == torch.float32
    assert torch.equal(read["parametrizations.w2.0.scale_inv"][0], held[3])


@pytest.mark.parametrize("case", [c for c in CASES if c not in EP_ONLY])
def test_greedy_tokens_match_dequantized_transformers(fp8_pair, reference, case):
    fp8, _ = fp8_pair(case)
    spec = CASES[case]
    ours, batch = load_model(fp8, dtype=spec.dtype), prompts(spec.prompt_lengths)
    ref_model, expected = reference(case)
    dlogit = max_prefill_dlogit(ours, ref_model, batch)
    logger.warning("FP8 %s: max |dlogit| vs dequantized transformers %.2e", case, dlogit)
    assert dlogit < spec.max_dlogit
    outs = LLM(str(fp8), dtype=spec.dtype, block_size=8, max_model_len=spec.max_model_len).generate(
        [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("case", EP_CASES)
def test_greedy_tokens_over_ep_ranks_match_dequantized_transformers(fp8_pair, reference, case):
    """Rank processes (four, or two for the hybrid's 6 experts), each reading only its experts'
    FP8 bytes and scales."""
    fp8, _ = fp8_pair(case)
    spec = CASES[case]
    batch = prompts(spec.prompt_lengths)
    _, expected = reference(case)
    options = dict(dtype=spec.dtype, block_size=8, max_model_len=spec.max_model_len, kv_cache_blocks=96)
    with LLM(str(fp8), ep=EP_CASES[case], **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected


def test_mla_kv_b_is_dequantized_once_not_every_step(fp8_pair, monkeypatch):
    """The FP8 kv_b_proj of each MLA layer is dequantized at its first forward and kept (the
    greedy tokens above come from the kept values); the other steps read no kv_b values."""
    fp8, _ = fp8_pair("deepseek_v3")
    model = load_model(fp8)
    layers = [layer.attn for layer in model.layers]
    kv_b_shape = layers[0].kv_b_proj.parametrizations.weight.original.shape
    reads = []
    real = fp8_module.dequantize

    def counted(weight, *args, **kwargs):
        if weight.shape == kv_b_shape:
            reads.append(weight.data_ptr())
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(fp8_module, "dequantize", counted)
    llm = LLM(str(fp8), block_size=8, max_model_len=96)
    llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert len(reads) == len(layers) == len(set(reads))  # one read per layer, over 32 steps


def test_resident_weights_are_at_most_055x_bf16(fp8_pair):
    fp8, plain = fp8_pair("qwen3_moe")

    def resident(model) -> int:
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    quantized = load_model(fp8, dtype=torch.bfloat16)
    assert quantized.layers[1].mlp.experts.parametrizations.w13.original.dtype == torch.float8_e4m3fn
    ratio = resident(quantized) / resident(load_model(plain, dtype=torch.bfloat16))
    logger.warning("FP8 qwen3_moe: resident weight bytes %.3fx of bf16", ratio)
    assert ratio <= 0.55


def test_partial_blocks_roundtrip_and_tensor_parallel_cuts():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 300, generator=g)  # 2x3 blocks, the last row and column partial
    q, scale_inv = quantize(weight, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    expected = reference_dequantize(q, scale_inv)
    assert torch.equal(dequantize(q, scale_inv[None], BLOCK, torch.float32), expected)
    assert (expected - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    # Every partial block's scale is its own tile's amax / 448.
    assert scale_inv[1, 2] == weight[128:, 256:].abs().max() / 448
    assert scale_inv[1, 2] != scale_inv[0, 0]
    assert scale_shard(Shard(0, 128, 72, 200), BLOCK, "w") == Shard(0, 1, 1, 2)  # the last rank's partial block
    with pytest.raises(CheckpointError, match="cuts a 128x128 scale block"):
        scale_shard(Shard(1, 64, 64, 128), BLOCK, "o_proj.weight")


@pytest.mark.parametrize(
    "scales,stored", [(torch.ones(2, 1), r"F32 \[2, 1\]"), (torch.ones(1, 1, dtype=torch.float64), r"F64 \[1, 1\]")]
)
def test_malformed_scales_are_refused_clearly(fp8_pair, tmp_path, scales, stored):
    """A scale grid of the wrong shape, or of a dtype no release stores scales in (float64 here:
    widening it would be inexact), is refused by name."""
    fp8, _ = fp8_pair("deepseek_v3")
    broken = shutil.copytree(fp8, tmp_path / "broken")
    with safe_open(broken / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    name = "model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"
    tensors[name] = scales
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} is {stored}, expected F32, BF16 or F16 \[1, 1\]"):
        load_model(broken)


def test_ep_rank_reads_only_its_experts_fp8_bytes_and_scales(tmp_path, monkeypatch):
    """`make-model --quantize fp8` over several shards (the index lists the scales); rank 1 of 4
    reads experts 2 and 3 only, FP8 bytes and scales, and holds exactly the full model's."""
    from moeserve.checkpoints import MakeModelSpec, make_model
    from moeserve.dispatch import ExpertPlacement
    from moeserve.models.checkpoint import CheckpointReader

    folder = make_model(
        MakeModelSpec(arch="deepseek_v3", experts=8, vocab=320, max_shard_bytes=64 * 1024, quantize="fp8"),
        tmp_path / "ckpt",
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in index
    read: list[str] = []
    original = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read.append(name) or original(self, name))
    full = load_model(folder).layers[1].mlp.experts.parametrizations.w13
    read.clear()
    placement = ExpertPlacement.contiguous(8, ep_size=4, rank=1)
    mine = load_model(folder, dispatcher=LoadOnly(placement)).layers[1].mlp.experts
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {2, 3} and any(n.endswith("_scale_inv") for n in read)
    w13 = mine.parametrizations.w13
    assert torch.equal(w13.original.view(torch.uint8), full.original[2:4].view(torch.uint8))
    assert torch.equal(w13[0].scale_inv, full[0].scale_inv[2:4]) and w13[0].scale_inv.shape == (2, 2, 1, 1)


def test_tensor_parallel_rank_holds_its_slice_of_weights_and_scales(make_checkpoint, tmp_path):
    """tp=2, rank 1 (loaded only, never run): its q_proj rows and o_proj columns, with their
    scales, are the single process's, in whole 16x16 blocks; 128x128 blocks, which the tiny
    heads would cut, are refused by name."""
    from moeserve.models.tensor_parallel import TensorParallel

    base = make_checkpoint("qwen3_moe", 7)
    small, large = shutil.copytree(base, tmp_path / "b16"), shutil.copytree(base, tmp_path / "b128")
    quantize_checkpoint(small, (16, 16))
    quantize_checkpoint(large, BLOCK)
    rank1 = TensorParallel(rank=1, size=2, group=object())  # loading never talks to the group
    full, mine = load_model(small).layers[0].attn, load_model(small, tp=rank1).layers[0].attn
    assert torch.equal(mine.q_proj.weight, full.q_proj.weight[32:])
    assert torch.equal(mine.o_proj.weight, full.o_proj.weight[:, 32:])
    q_scales = mine.q_proj.parametrizations.weight[0].scale_inv
    assert torch.equal(q_scales, full.q_proj.parametrizations.weight[0].scale_inv[:, 2:])
    with pytest.raises(CheckpointError, match=r"entries \[32, 64\) of dim 0 of FP8 tensor .*q_proj.weight"):
        load_model(large, tp=rank1)
