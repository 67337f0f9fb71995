"""gpt-oss MXFP4 checkpoints against transformers reading the same checkpoint.

The checkpoint is written by transformers (random weights) and its experts rewritten in the
layout gpt-oss-20b/120b are published in (`*_blocks` / `*_scales` uint8, bf16 expert biases, the
published `quantization_config`). The reference is transformers loading that MXFP4 checkpoint
itself, dequantizing it with its own code into float32 (what it does on a machine without its
MXFP4 kernels); moeserve keeps the experts packed and dequantizes at use, so it must match it as
it matches an unquantized checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
from helpers.hf_configs import VOCAB
from helpers.load_only import LoadOnly
from helpers.reference import hf_greedy_tokens, hf_model, max_prefill_dlogit
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.checkpoints.quantize_mxfp4 import MODULES_NOT_CONVERTED, quantize_checkpoint
from moeserve.models import load_model
from moeserve.models.checkpoint import CheckpointError
from moeserve.models.loader import model_config, weight_bytes
from moeserve.mxfp4_format import E2M1_VALUES, dequantize, pack, quantize, unpack

logger = logging.getLogger(__name__)

PUBLISHED = {"modules_to_not_convert": MODULES_NOT_CONVERTED, "quant_method": "mxfp4"}
EXPERTS = 8  # four ranks of two
PROMPT_LENGTHS = (1, 9, 26)  # the tiny config's window is 8: one prompt within it, two past it
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint, tmp_path_factory):
    """(MXFP4 folder, the unquantized folder it was made from)."""
    base = make_checkpoint("gpt_oss", 7, num_local_experts=EXPERTS)
    mxfp4 = shutil.copytree(base, tmp_path_factory.mktemp("mxfp4") / "gpt_oss")
    quantize_checkpoint(mxfp4)
    return mxfp4, base


@pytest.fixture(scope="module")
def reference(checkpoints):
    """(transformers on the MXFP4 checkpoint, its 32 greedy tokens per prompt)."""
    model = hf_model(checkpoints[0])
    return model, [hf_greedy_tokens(model, p, 32) for p in prompts()]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def test_bit_layout_codes_scales_and_transformers_order():
    codes = torch.arange(16, dtype=torch.uint8)
    assert pack(codes).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # even code in the low nibble
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack(unpack(every_byte)), every_byte)
    # One row of five blocks, each holding every code twice, under known e8m0 exponents.
    exponents = [127, 128, 120, 0, 250]  # 0: 2 ** -127, subnormal in float32
    blocks = pack(codes.repeat(2)).repeat(len(exponents), 1)[None]  # [1, 5, 16]
    got = dequantize(blocks, torch.tensor([exponents], dtype=torch.uint8), torch.float32)
    want = [math.ldexp(v, b - 127) for b in exponents for v in E2M1_VALUES * 2]
    assert got.shape == (1, 160) and got[0].tolist() == want
    # Codes whose block holds a +-6 (so its scale is found again) survive a quantize round trip.
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 4, 64), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 comes back as +0
    codes[..., ::32] = 7
    scales = torch.randint(100, 150, (3, 4, 2), generator=g, dtype=torch.uint8)
    packed = pack(codes).reshape(3, 4, 2, 16)
    again = quantize(dequantize(packed, scales, torch.float32))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)
    # transformers' own dequantization reads the same bytes as ours, transposed to its [E, in, out].
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    random_bytes = torch.randint(0, 256, (3, 4, 2, 16), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(random_bytes, scales, dtype=torch.float32)
    assert torch.equal(dequantize(random_bytes, scales, torch.float32).transpose(1, 2), theirs)


def test_checkpoint_has_the_published_layout(checkpoints):
    mxfp4, _ = checkpoints
    assert json.loads((mxfp4 / "config.json").read_text())["quantization_config"] == PUBLISHED
    experts = "model.layers.1.mlp.experts."
    want = {
        "gate_up_proj_blocks": ("U8", [EXPERTS, 64, 2, 16]),  # [E, 2I, H/32, 16]
        "gate_up_proj_scales": ("U8", [EXPERTS, 64, 2]),
        "down_proj_blocks": ("U8", [EXPERTS, 64, 1, 16]),  # [E, H, I/32, 16]
        "down_proj_scales": ("U8", [EXPERTS, 64, 1]),
        "gate_up_proj_bias": ("BF16", [EXPERTS, 64]),
        "down_proj_bias": ("BF16", [EXPERTS, 64]),
    }
    with safe_open(mxfp4 / "model.safetensors", framework="pt") as f:
        got = {n.removeprefix(experts): (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
        assert {n: v for n, v in got.items() if n in want} == want
        assert experts + "gate_up_proj" not in f.keys() and experts + "down_proj" not in f.keys()
        for kept in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.router.weight", "lm_head.weight"):
            assert f.get_slice(kept).get_dtype() == "F32"


def test_greedy_tokens_match_transformers(checkpoints, reference):
    mxfp4, _ = checkpoints
    ours, batch = load_model(mxfp4), prompts()
    ref_model, expected = reference
    dlogit = max_prefill_dlogit(ours, ref_model, batch)
    logger.warning("MXFP4 gpt_oss: max |dlogit| vs transformers dequantizing the checkpoint %.2e", dlogit)
    assert dlogit < 1e-4
    outs = LLM(str(mxfp4), block_size=8, max_model_len=96).generate(
        [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_greedy_tokens_at_ep4_match_transformers(checkpoints, reference):
    """Four rank processes, each holding only its two experts' packed bytes and scales."""
    mxfp4, _ = checkpoints
    with LLM(str(mxfp4), ep=4, block_size=8, max_model_len=96, kv_cache_blocks=96) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[1]


def test_resident_expert_bytes_against_bf16(checkpoints):
    mxfp4, base = checkpoints
    packed, plain = load_model(mxfp4, dtype=torch.bfloat16), load_model(base, dtype=torch.bfloat16)
    stored = packed.layers[0].mlp.experts.parametrizations.w13
    assert stored.original.dtype == torch.uint8 and stored.original.shape == (EXPERTS, 64, 2, 16)
    assert packed.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    ratio = weight_bytes(packed).experts / weight_bytes(plain).experts
    logger.warning("MXFP4 gpt_oss: resident expert weight bytes %.3fx of bf16 (biases included)", ratio)
    # Codes and scales are 17/64 of bf16; the bf16 biases stay as they were.
    assert ratio <= 0.3


def test_ep_rank_reads_only_its_experts_bytes(tmp_path, monkeypatch):
    """`make-model --quantize mxfp4` over several shards (the index names the new tensors); rank 1
    of 4 reads experts 2 and 3 only, and holds exactly the full model's rows, gate/up de-interleaved."""
    from moeserve.checkpoints import MakeModelSpec, make_model
    from moeserve.dispatch import ExpertPlacement
    from moeserve.models.checkpoint import CheckpointReader

    folder = make_model(
        MakeModelSpec(arch="gpt_oss", experts=8, vocab=320, max_shard_bytes=32 * 1024, quantize="mxfp4"), tmp_path / "m"
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert (
        "model.layers.1.mlp.experts.down_proj_scales" in index and "model.layers.1.mlp.experts.down_proj" not in index
    )
    assert len(set(index.values())) > 1
    full = load_model(folder).layers[1].mlp.experts
    read: list[tuple[str, int]] = []
    original = CheckpointReader.get_part
    monkeypatch.setattr(
        CheckpointReader,
        "get_part",
        lambda self, name, dim, start, length: read.append((name, start)) or original(self, name, dim, start, length),
    )
    mine = load_model(folder, dispatcher=LoadOnly(ExpertPlacement.contiguous(8, ep_size=4, rank=1))).layers[1]
    assert {start for name, start in read if name.endswith(("_blocks", "_scales"))} == {2, 3}
    mine = mine.mlp.experts
    for param in ("w13", "w2"):
        ours, theirs = getattr(mine.parametrizations, param), getattr(full.parametrizations, param)
        assert torch.equal(ours.original, theirs.original[2:4]) and torch.equal(ours[0].scales, theirs[0].scales[2:4])
    assert torch.equal(mine.b13, full.b13[2:4])


def test_mxfp4_refusals(checkpoints, tmp_path):
    """Only gpt-oss's experts exist in MXFP4: another architecture declaring it, an MXFP4 tensor
    elsewhere, and a scale tensor of the wrong dtype are refused by name, as is the Triton path."""
    from moeserve.ops.triton_ops import TritonOps

    mxfp4, _ = checkpoints
    reason = TritonOps.supports_model(model_config(mxfp4))
    assert reason is not None and "MXFP4" in reason
    broken = shutil.copytree(mxfp4, tmp_path / "broken")
    with safe_open(broken / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    scales = "model.layers.0.mlp.experts.down_proj_scales"
    save_file({**tensors, scales: tensors[scales].float()}, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {scales} is F32 \[8, 64, 1\], expected U8 \[8, 64, 1\]"):
        load_model(broken)
    stray = "model.layers.0.self_attn.q_proj.weight_blocks"
    save_file({**tensors, stray: tensors[scales].clone()}, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {stray} looks MXFP4: only gpt-oss's expert projections"):
        load_model(broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3MoeForCausalLM"])))
    with pytest.raises(CheckpointError, match="'mxfp4' is read for gpt-oss's experts only .* not Qwen3MoeForCausalLM"):
        model_config(broken)
    (broken / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "awq"})))
    supported = r"\(supported quant methods: fp8, mxfp4, compressed-tensors, modelopt\)"
    with pytest.raises(CheckpointError, match=r"'awq' is not supported " + supported):
        model_config(broken)
