"""FP8 block-quantized checkpoints against transformers running their dequantized weights.

Each case is a checkpoint written by transformers (random weights), rewritten in the layout the
FP8 releases use (float8_e4m3fn weights, float32 `weight_scale_inv` per 128x128 block,
`quantization_config`). The reference is transformers in fp32 on a copy whose weights are the
FP8 values times their scales, dequantized here block by block (not by moeserve's code), so
moeserve, which keeps the FP8 bytes and dequantizes at use, must match it as it matches an
unquantized checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from helpers.hf_configs import VOCAB
from helpers.load_only import LoadOnly
from helpers.reference import hf_greedy_tokens, hf_model, max_prefill_dlogit
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
CASES = [("deepseek_v3", dict()), ("qwen3_moe", QWEN3)]
PROMPT_LENGTHS = (1, 9, 26)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def reference_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The published rule, tile by tile: weight.float() * scale_inv of its 128x128 block."""
    out = torch.empty(weight.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = weight[rows, cols].float() * scale_inv[i, j]
    return out


@pytest.fixture(scope="module")
def reference(fp8_pair):
    """arch -> (transformers on the dequantized weights, its 32 greedy tokens per prompt)."""
    cache = {}

    def get(arch: str, overrides: dict):
        if arch not in cache:
            cache[arch] = hf_greedy(fp8_pair(arch, overrides)[1], prompts())
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def fp8_pair(make_checkpoint, tmp_path_factory):
    """arch -> (FP8 folder, folder of its dequantized weights in fp32)."""
    built = {}

    def get(arch: str, overrides: dict):
        if arch not in built:
            base = make_checkpoint(arch, 7, **overrides)
            root = tmp_path_factory.mktemp(f"fp8-{arch}")
            fp8, plain = shutil.copytree(base, root / "fp8"), shutil.copytree(base, root / "dequantized")
            quantize_checkpoint(fp8, BLOCK)
            with safe_open(fp8 / "model.safetensors", framework="pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            values = {
                n: reference_dequantize(t, tensors[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
                for n, t in tensors.items()
                if not n.endswith("_scale_inv")
            }
            save_file(values, plain / "model.safetensors", metadata={"format": "pt"})
            built[arch] = fp8, plain
        return built[arch]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(folder, batch: list[list[int]]):
    model = hf_model(folder)
    return model, [hf_greedy_tokens(model, p, 32) for p in batch]


def test_checkpoint_has_the_published_layout(fp8_pair):
    fp8, _ = fp8_pair("qwen3_moe", QWEN3)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == PUBLISHED
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        down = "model.layers.0.mlp.experts.3.down_proj.weight"
        assert f.get_slice(down).get_dtype() == "F8_E4M3" and f.get_slice(down).get_shape() == [192, 160]
        assert f.get_slice(down + "_scale_inv").get_dtype() == "F32"
        assert f.get_slice(down + "_scale_inv").get_shape() == [2, 2]
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
            assert f.get_slice(kept).get_dtype() == "F32" and kept + "_scale_inv" not in f.keys()


@pytest.mark.parametrize("arch,overrides", CASES, ids=[a for a, _ in CASES])
def test_greedy_tokens_match_dequantized_transformers(fp8_pair, reference, arch, overrides):
    fp8, _ = fp8_pair(arch, overrides)
    ours, batch = load_model(fp8), prompts()
    ref_model, expected = reference(arch, overrides)
    dlogit = max_prefill_dlogit(ours, ref_model, batch)
    logger.warning("FP8 %s: max |dlogit| vs dequantized transformers %.2e", arch, dlogit)
    assert dlogit < 1e-4
    outs = LLM(str(fp8), block_size=8, max_model_len=96).generate(
        [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_greedy_tokens_at_ep4_match_dequantized_transformers(fp8_pair, reference):
    """Four rank processes, each reading only its two experts' FP8 bytes and scales."""
    fp8, _ = fp8_pair("deepseek_v3", {})
    batch = prompts()
    _, expected = reference("deepseek_v3", {})
    with LLM(str(fp8), ep=4, block_size=8, max_model_len=96, kv_cache_blocks=96) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected


def test_mla_kv_b_is_dequantized_once_not_every_step(fp8_pair, monkeypatch):
    """The FP8 kv_b_proj of each MLA layer is dequantized at its first forward and kept (the
    greedy tokens above come from the kept values); the other steps read no kv_b values."""
    fp8, _ = fp8_pair("deepseek_v3", {})
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
    fp8, plain = fp8_pair("qwen3_moe", QWEN3)

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


def test_malformed_scales_are_refused_clearly(fp8_pair, tmp_path):
    fp8, _ = fp8_pair("deepseek_v3", {})
    broken = shutil.copytree(fp8, tmp_path / "broken")
    with safe_open(broken / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    name = "model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"
    tensors[name] = torch.ones(2, 1)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} is F32 \[2, 1\], expected F32 \[1, 1\]"):
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
