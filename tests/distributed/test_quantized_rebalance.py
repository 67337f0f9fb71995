"""A live rebalance moves quantized experts whole: FP8 bytes with their block scales, MXFP4 codes
with their e8m0 scales, INT4 words with their bf16 group scales, NVFP4 codes with their FP8
block scales and per-part global scales (`eplb.transfer.move_experts` moves every parameter of the experts module,
the parametrizations' included). Two gloo ranks load their share under one expert map, move to
a map that sends every expert to another slot (most to the other rank), and must then hold
exactly what loading under the new map gives, byte for byte."""

from __future__ import annotations

import shutil

from quantized_moves import moved_equals_loaded
from ranks import run_ranks

from moeserve.checkpoints import quantize_fp8, quantize_int4, quantize_mxfp4, quantize_nvfp4
from moeserve.dispatch import ExpertMap
from moeserve.models import load_model

NUM_EXPERTS = 8


def shifted_map(num_layers: int) -> ExpertMap:
    """Layer i puts expert (3 s + i + 1) mod E in slot s: a different permutation per layer,
    none leaving an expert where the default map has it."""
    layers = tuple(tuple((3 * s + i + 1) % NUM_EXPERTS for s in range(NUM_EXPERTS)) for i in range(num_layers))
    return ExpertMap(layers, NUM_EXPERTS, 2)


def test_rebalance_moves_quantized_experts_with_their_scales(make_checkpoint, tmp_path):
    fp8 = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=NUM_EXPERTS), tmp_path / "fp8")
    quantize_fp8.quantize_checkpoint(fp8, (16, 16))  # several scale blocks per expert
    mxfp4 = shutil.copytree(make_checkpoint("gpt_oss", 5, num_local_experts=NUM_EXPERTS), tmp_path / "mxfp4")
    quantize_mxfp4.quantize_checkpoint(mxfp4)
    int4 = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=NUM_EXPERTS), tmp_path / "int4")
    quantize_int4.quantize_checkpoint(int4)
    nvfp4 = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=NUM_EXPERTS), tmp_path / "nvfp4")
    quantize_nvfp4.quantize_checkpoint(nvfp4)
    folders = (fp8, mxfp4, int4, nvfp4)
    for folder in folders:
        held = load_model(folder).moe_blocks()[0].experts.parametrizations
        assert "w13" in held and "w2" in held, "the experts are held quantized, under a parametrization"
    num_layers = 2  # both tiny configs: two layers, both MoE
    old, new = ExpertMap.default(NUM_EXPERTS, 0, 2, num_layers), shifted_map(num_layers)
    assert run_ranks(2, moved_equals_loaded, [str(f) for f in folders], old, new) == [[], []]
