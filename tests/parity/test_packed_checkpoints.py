"""INT4 (compressed-tensors pack-quantized, as Kimi-K2-Thinking/K2.5 publish their experts) and
NVFP4 (ModelOpt) checkpoints against transformers running their dequantized twins.

Each case is a checkpoint written by transformers (random weights), its routed experts rewritten
in the published layout and everything else kept in bfloat16 as the releases do. The twin is the
same checkpoint with every quantized expert replaced by its values, decoded here independently
of moeserve: INT4 by compressed-tensors' own decompressor, NVFP4 by the published rule (code
times its FP8 block scale times the tensor's global scale). moeserve keeps the experts packed and
dequantizes them at use, so it must match transformers on the twin as it matches any checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from helpers.hf_configs import VOCAB
from helpers.reference import hf_greedy_tokens, hf_model, max_prefill_dlogit
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import quantize_int4, quantize_nvfp4
from moeserve.models import load_model

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (1, 9, 26)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the published code values, written out here


@dataclass(frozen=True)
class Case:
    arch: str
    fmt: str  # int4 or nvfp4
    overrides: dict = field(default_factory=dict)


CASES = {
    "int4-deepseek_v3": Case("deepseek_v3", "int4"),
    "nvfp4-qwen3_moe": Case("qwen3_moe", "nvfp4", dict(num_experts=8)),
}
LAYOUTS = [(1, 1), (4, 1), (4, 2)]


def int4_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """compressed-tensors' decompression of one pack-quantized module, its bf16 scales widened
    first: the library computes in the scales' dtype, and q * scale needs more bits than bf16."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    state = {s: tensors[f"{module}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
    state["weight_scale"] = state["weight_scale"].float()
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()


def nvfp4_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The ModelOpt rule, block by block: e2m1(code) * weight_scale * weight_scale_2."""
    codes = tensors[f"{module}.weight"]
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).long()
    magnitude = torch.tensor(E2M1)[nibbles & 7]
    values = torch.where(nibbles >= 8, -magnitude, magnitude)
    scale = tensors[f"{module}.weight_scale"].float().repeat_interleave(16, dim=-1)
    return values * scale * tensors[f"{module}.weight_scale_2"].float()


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    """case -> (quantized folder, its dequantized twin in float32)."""
    built = {}

    def get(case: str):
        if case not in built:
            spec = CASES[case]
            base = make_checkpoint(spec.arch, 7, **spec.overrides)
            root = tmp_path_factory.mktemp(case)
            packed, twin = shutil.copytree(base, root / "packed"), shutil.copytree(base, root / "twin")
            (quantize_int4 if spec.fmt == "int4" else quantize_nvfp4).quantize_checkpoint(packed)
            with safe_open(packed / "model.safetensors", framework="pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            values = {}
            for name, tensor in tensors.items():
                if name.endswith(".weight_packed"):
                    values[name.removesuffix("_packed")] = int4_values(tensors, name.removesuffix(".weight_packed"))
                elif tensor.dtype == torch.uint8:
                    values[name] = nvfp4_values(tensors, name.removesuffix(".weight"))
                elif tensor.is_floating_point() and not name.endswith(("_scale", "_scale_2")):
                    values[name] = tensor.float()
            save_file(values, twin / "model.safetensors", metadata={"format": "pt"})
            built[case] = packed, twin
        return built[case]

    return get


@pytest.fixture(scope="module")
def reference(pair):
    """case -> (transformers on the twin in float32, its 32 greedy tokens per prompt)."""
    cache = {}

    def get(case: str):
        if case not in cache:
            model = hf_model(pair(case)[1])
            cache[case] = model, [hf_greedy_tokens(model, p, 32) for p in prompts()]
        return cache[case]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_dequantized_transformers(pair, reference, case):
    packed, _ = pair(case)
    ref_model, expected = reference(case)
    dlogit = max_prefill_dlogit(load_model(packed), ref_model, prompts())
    logger.warning("%s: max |dlogit| vs transformers on the dequantized twin %.2e", case, dlogit)
    assert dlogit < 1e-4
    outs = LLM(str(packed), block_size=8, max_model_len=96).generate(
        [{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
