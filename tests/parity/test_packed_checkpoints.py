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

import json
import logging
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from helpers.hf_configs import VOCAB
from helpers.load_only import LoadOnly
from helpers.reference import hf_greedy_tokens, hf_model, max_prefill_dlogit
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import quantize_int4, quantize_nvfp4
from moeserve.models import load_model
from moeserve.models.loader import weight_bytes

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (1, 9, 26)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the published code values, written out here


@dataclass(frozen=True)
class Case:
    arch: str
    fmt: str  # int4 or nvfp4
    overrides: dict = field(default_factory=dict)
    all_linears: bool = False  # attention, shared experts and dense MLPs quantized too


CASES = {
    "int4-deepseek_v3": Case("deepseek_v3", "int4"),
    "nvfp4-qwen3_moe": Case("qwen3_moe", "nvfp4", dict(num_experts=8)),
}
LAYOUTS = [(1, 1), (4, 1), (4, 2)]
# Every linear layer quantized but the routers and the LM head; MLA's widths made multiples of 32.
ALL_LINEARS = {
    "int4-all-deepseek_v3": Case("deepseek_v3", "int4", dict(q_lora_rank=32, kv_lora_rank=32, v_head_dim=16), True),
    "nvfp4-all-qwen3_moe": Case("qwen3_moe", "nvfp4", dict(num_experts=8), True),
}


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
            spec = {**CASES, **ALL_LINEARS}[case]
            base = make_checkpoint(spec.arch, 7, **spec.overrides)
            root = tmp_path_factory.mktemp(case)
            packed, twin = shutil.copytree(base, root / "packed"), shutil.copytree(base, root / "twin")
            (quantize_int4 if spec.fmt == "int4" else quantize_nvfp4).quantize_checkpoint(
                packed, all_linears=spec.all_linears
            )
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


@pytest.mark.parametrize("ep,tp", [(4, 1), (4, 2)], ids=["ep4", "ep4-tp2"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_at_ep4_and_tp2_match_dequantized_transformers(pair, reference, case, ep, tp):
    """Rank processes each holding only their experts' packed bytes and scales; under tp=2 the
    (unquantized) attention is split too."""
    packed, _ = pair(case)
    with LLM(str(packed), ep=ep, tp=tp, block_size=8, max_model_len=96, kv_cache_blocks=96) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(case)[1]


@pytest.mark.parametrize("case", ALL_LINEARS)
def test_quantized_attention_and_shared_experts_match_dequantized_transformers(pair, reference, case):
    """Releases that quantize attention, shared experts and dense MLPs too: those layers are
    dequantized at load (the routed experts stay packed): prefill logits as transformers' on the
    twin for both formats, and greedy tokens under tp=2 (each rank's cut of the dequantized MLA
    weights) for INT4, the costlier multi-process check run once."""
    packed, twin = pair(case)
    model = load_model(packed)
    assert model.layers[-1].mlp.experts.parametrizations.w13.original.dtype in (torch.int32, torch.uint8)
    with safe_open(packed / "model.safetensors", framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    quantized = [n for n, d in dtypes.items() if d in ("I32", "U8") and ".mlp.experts." not in n]
    int4 = ALL_LINEARS[case].fmt == "int4"
    for kind in ("self_attn.o_proj", "shared_experts.down_proj", "layers.0.mlp.down_proj") if int4 else ("q_proj",):
        assert any(kind in n for n in quantized), kind
    dlogit = max_prefill_dlogit(model, reference(case)[0] if int4 else hf_model(twin), prompts())
    logger.warning("%s: max |dlogit| vs transformers on the dequantized twin %.2e", case, dlogit)
    assert dlogit < 1e-4
    if int4:
        with LLM(str(packed), ep=2, tp=2, block_size=8, max_model_len=96, kv_cache_blocks=96) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference(case)[1]


def checkpoint_bytes(folder) -> int:
    """The bytes of every tensor the checkpoint stores."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            total += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys())
    return total


@pytest.mark.parametrize("case", CASES)
def test_resident_weight_bytes_within_110_percent_of_the_checkpoint(pair, case):
    """Loaded in bfloat16, the model holds about what the checkpoint stores: the packed experts
    are not widened (the dequantized twin, in bf16, would be 3.5x the experts' bytes)."""
    packed, twin = pair(case)
    model = load_model(packed, dtype=torch.bfloat16)
    experts = model.layers[-1].mlp.experts
    stored = experts.parametrizations.w13.original
    assert stored.dtype == (torch.int32 if CASES[case].fmt == "int4" else torch.uint8)
    assert experts.w13.dtype == torch.bfloat16
    sizes = weight_bytes(model)
    resident, on_disk = sizes.experts + sizes.other, checkpoint_bytes(packed)
    widened = weight_bytes(load_model(twin, dtype=torch.bfloat16)).experts
    logger.warning(
        "%s: resident weight bytes in bf16 %d = %.3fx the checkpoint's %d; experts %.3fx of bf16",
        case,
        resident,
        resident / on_disk,
        on_disk,
        sizes.experts / widened,
    )
    assert resident <= 1.10 * on_disk
    assert sizes.experts <= 0.3 * widened


def test_checkpoints_have_the_published_layouts(pair):
    int4, _ = pair("int4-deepseek_v3")
    config = json.loads((int4 / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["quant_method"] == "compressed-tensors"
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "model.layers.0.mlp.down_proj" in config["ignore"] and "lm_head" in config["ignore"]
    expert = "model.layers.1.mlp.experts.5.down_proj"
    with safe_open(int4 / "model.safetensors", framework="pt") as f:
        layout = {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
        assert layout[expert + ".weight_packed"] == ("I32", [64, 4])  # [H, I / 8]
        assert layout[expert + ".weight_scale"] == ("BF16", [64, 1])  # [H, I / 32]
        assert f.get_tensor(expert + ".weight_shape").tolist() == [64, 32]
        assert expert + ".weight" not in layout
        assert layout["model.layers.1.mlp.shared_experts.up_proj.weight"][0] == "BF16"
        assert layout["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    nvfp4, _ = pair("nvfp4-qwen3_moe")
    assert "quantization_config" not in json.loads((nvfp4 / "config.json").read_text())
    modelopt = json.loads((nvfp4 / "hf_quant_config.json").read_text())["quantization"]
    assert modelopt["quant_algo"] == "NVFP4" and modelopt["group_size"] == 16
    expert = "model.layers.0.mlp.experts.3.gate_proj"
    with safe_open(nvfp4 / "model.safetensors", framework="pt") as f:
        layout = {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
        assert layout[expert + ".weight"] == ("U8", [32, 32])  # [I, H / 2]
        assert layout[expert + ".weight_scale"] == ("F8_E4M3", [32, 4])  # [I, H / 16]
        assert layout[expert + ".weight_scale_2"] == ("F32", []) and layout[expert + ".input_scale"] == ("F32", [])
        assert layout["model.layers.0.self_attn.q_proj.weight"][0] == "BF16"


def test_int4_bytes_are_compressed_tensors_own():
    """Our packing is the library's `pack_to_int32`, word for word, and our dequantization its
    decompression (with float32 scales); signed codes, -8 and 7 included, round trip."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from moeserve.int4_format import dequantize, pack, quantize, unpack

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (6, 64), generator=g, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-8, 7])
    assert torch.equal(pack(codes), pack_to_int32(codes, 4)) and torch.equal(unpack(pack(codes)), codes)
    weight = torch.randn(6, 64, generator=g)
    packed, scale = quantize(weight, 32)
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale, "m.weight_shape": torch.tensor([6, 64])}
    ours = dequantize(packed, scale, torch.float32)
    assert torch.equal(ours, int4_values(tensors, "m"))
    # Within half a step, but for the group's largest value: 7.5 steps, clamped to 7, of a scale
    # rounded to bf16 (which may take it past 7.5 by bf16's relative step, 2 ** -8 of it).
    assert ((ours - weight).abs() <= 0.53 * scale.float().repeat_interleave(32, dim=-1)).all()


def test_nvfp4_codes_are_the_published_rule():
    """Every code under known FP8 block scales and a global scale decodes as the rule says, and
    a quantized weight comes back within half of e2m1's widest gap (2) of its block's step."""
    from moeserve.nvfp4_format import dequantize, quantize

    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2, 2)  # [2, 16]: two blocks of every code twice
    scale = torch.tensor([[0.5, 448.0], [2.0**-9, 3.0]]).to(torch.float8_e4m3fn)
    tensors = {"m.weight": packed, "m.weight_scale": scale, "m.weight_scale_2": torch.tensor(0.25)}
    got = dequantize(packed, scale, torch.tensor([0.25]), torch.float32)
    assert torch.equal(got, nvfp4_values(tensors, "m"))
    assert got[0, :16].tolist() == [v * 0.5 * 0.25 for v in E2M1 + tuple(-v for v in E2M1)]
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    codes, scale, global_scale = quantize(weight)
    step = scale.float().repeat_interleave(16, dim=-1) * global_scale
    assert ((dequantize(codes, scale, global_scale[None], torch.float32) - weight).abs() <= step * 1.01).all()


def test_ep_rank_reads_only_its_experts_packed_bytes(pair, monkeypatch):
    """Rank 1 of 4 reads experts 2 and 3 only, and holds exactly the full model's rows and scales."""
    from moeserve.dispatch import ExpertPlacement
    from moeserve.models.checkpoint import CheckpointReader

    for case in CASES:
        packed, _ = pair(case)
        full = dict(load_model(packed).layers[1].mlp.experts.named_parameters())
        read: list[str] = []
        monkeypatch.setattr(
            CheckpointReader,
            "get",
            lambda self, name, read=read, get=CheckpointReader.get: read.append(name) or get(self, name),
        )
        mine = load_model(packed, dispatcher=LoadOnly(ExpertPlacement.contiguous(8, ep_size=4, rank=1)))
        monkeypatch.undo()
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".mlp.experts." in n} == {2, 3}, case
        held = dict(mine.layers[1].mlp.experts.named_parameters())
        assert held.keys() == full.keys() and len(held) == {"int4": 4, "nvfp4": 6}[CASES[case].fmt], case
        for name, tensor in held.items():
            assert torch.equal(tensor, full[name][2:4]), (case, name)


def broken_copy(folder, tmp_path, config=None, **tensors: torch.Tensor):
    """A copy of `folder` with config.json's quantization_config (and any `tensors`) replaced."""
    broken = shutil.copytree(folder, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}")
    if config is not None:
        raw = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps(dict(raw, quantization_config=config)))
    if tensors:
        with safe_open(broken / "model.safetensors", framework="pt") as f:
            stored = {n: f.get_tensor(n) for n in f.keys()}
        save_file({**stored, **tensors}, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


def test_int4_refusals_name_the_tensor_and_field(pair, tmp_path):
    """Unknown formats and schemes, group sizes that do not divide the width, malformed scales
    and shapes, and quantized layers other than routed experts: refused at load, by name."""
    from moeserve.models.checkpoint import CheckpointError
    from moeserve.models.loader import model_config

    int4, _ = pair("int4-deepseek_v3")
    published = json.loads((int4 / "config.json").read_text())["quantization_config"]
    group = published["config_groups"]["group_0"]
    with pytest.raises(CheckpointError, match=r"quantization_config.format 'marlin-24': only 'pack-quantized'"):
        model_config(broken_copy(int4, tmp_path, dict(published, format="marlin-24")))
    asymmetric = {"group_0": dict(group, weights=dict(group["weights"], symmetric=False))}
    with pytest.raises(CheckpointError, match=r"config_groups.group_0.weights.symmetric is False: only True"):
        model_config(broken_copy(int4, tmp_path, dict(published, config_groups=asymmetric)))
    wide = {"group_0": dict(group, weights=dict(group["weights"], group_size=48))}
    expert = "model.layers.1.mlp.experts.0.gate_proj"
    with pytest.raises(
        CheckpointError, match=rf"tensor {expert}.weight_packed: quantization_config group_size 48 does not divide"
    ):
        load_model(broken_copy(int4, tmp_path, dict(published, config_groups=wide)))
    half_dense = [m for m in published["ignore"] if m != "model.layers.0.mlp.gate_proj"]
    with pytest.raises(CheckpointError, match=r"quantizes model.layers.0.mlp.gate_proj but not .*0.mlp.up_proj"):
        load_model(broken_copy(int4, tmp_path, dict(published, ignore=half_dense)))
    one_plain = [*published["ignore"], "model.layers.1.mlp.experts.6.up_proj"]
    with pytest.raises(CheckpointError, match=r"quantizes .*experts.0.gate_proj but not .*experts.6.up_proj"):
        load_model(broken_copy(int4, tmp_path, dict(published, ignore=one_plain)))
    with safe_open(int4 / "model.safetensors", framework="pt") as f:
        scale = f.get_tensor(f"{expert}.weight_scale")
    nan = scale.clone()
    nan[3, 1] = float("nan")
    with pytest.raises(CheckpointError, match=rf"tensor {expert}.weight_scale holds nan at \[3, 1\]: scales must be"):
        load_model(broken_copy(int4, tmp_path, **{f"{expert}.weight_scale": nan}))
    up = expert.replace("gate_proj", "up_proj")  # gate's scales are bf16: a parameter holds one dtype
    with pytest.raises(CheckpointError, match=rf"tensor {up}.weight_scale is F32 \[32, 2\], expected BF16 \[32, "):
        load_model(broken_copy(int4, tmp_path, **{f"{up}.weight_scale": scale.float()}))
    with pytest.raises(CheckpointError, match=rf"tensor {expert}.weight_shape says \[32, 32\], config.json implies"):
        load_model(broken_copy(int4, tmp_path, **{f"{expert}.weight_shape": torch.tensor([32, 32])}))


def test_nvfp4_refusals_and_both_config_forms(pair, tmp_path):
    """hf_quant_config.json and config.json's flat form read alike; an unknown quant_algo, a
    malformed global scale and a block scale of the wrong dtype are refused by name."""
    from moeserve.config import NVFP4Config
    from moeserve.models.checkpoint import CheckpointError
    from moeserve.models.loader import model_config
    from moeserve.plan.shapes import load_shape

    nvfp4, _ = pair("nvfp4-qwen3_moe")
    exclude = json.loads((nvfp4 / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert model_config(nvfp4).weight_quant == NVFP4Config(tuple(exclude))
    assert load_shape(str(nvfp4)).expert_weight_bytes == pytest.approx(4.5 / 8)  # the planner reads it too
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": exclude}
    assert model_config(broken_copy(nvfp4, tmp_path, flat)).weight_quant == NVFP4Config(tuple(exclude))
    with pytest.raises(CheckpointError, match=r"quant_method 'modelopt' with quant_algo 'FP8': only 'NVFP4'"):
        model_config(broken_copy(nvfp4, tmp_path, dict(flat, quant_algo="FP8")))
    expert = "model.layers.1.mlp.experts.4.down_proj"
    with pytest.raises(CheckpointError, match=rf"tensor {expert}.weight_scale_2 holds 0.0 at \[\]: .* and positive"):
        load_model(broken_copy(nvfp4, tmp_path, **{f"{expert}.weight_scale_2": torch.tensor(0.0)}))
    with safe_open(nvfp4 / "model.safetensors", framework="pt") as f:
        scale = f.get_tensor(f"{expert}.weight_scale")
    with pytest.raises(CheckpointError, match=rf"tensor {expert}.weight_scale is F32 \[64, 2\], expected F8_E4M3"):
        load_model(broken_copy(nvfp4, tmp_path, **{f"{expert}.weight_scale": scale.float()}))


def kimi_k25_checkpoint(int4, folder):
    """The INT4 DeepSeek-V3 checkpoint laid out as Kimi-K2.5's multimodal release: config under
    text_config (its quantization_config with it, module names under the prefix), every tensor
    under `language_model.`, and a vision tower beside it."""
    folder = shutil.copytree(int4, folder)
    text = json.loads((folder / "config.json").read_text())
    quant = text["quantization_config"]
    quant["ignore"] = [f"language_model.{m}" for m in quant["ignore"]] + ["re:vision_tower.*", "re:mm_projector.*"]
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": dict(text, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2"),
        "vision_config": {"hidden_size": 16, "num_hidden_layers": 1, "patch_size": 2},
    }
    (folder / "config.json").write_text(json.dumps(config))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {f"language_model.{n}": f.get_tensor(n) for n in f.keys()}
    tower = {
        "vision_tower.patch_embed.proj.weight": torch.ones(16, 12),
        "mm_projector.proj.0.weight": torch.ones(64, 16),
    }
    save_file({**tensors, **tower}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_kimi_k25_text_model_matches_its_int4_deepseek_twin(pair, reference, tmp_path):
    """Kimi-K2.5's layout (text model under `language_model.`, config under text_config) reads the
    same weights as the DeepSeek-V3 INT4 checkpoint it was made from: transformers' tokens on
    that checkpoint's dequantized twin, the vision tower never read."""
    from moeserve.config import PackedInt4Config
    from moeserve.models.loader import model_config

    int4, _ = pair("int4-deepseek_v3")
    kimi = kimi_k25_checkpoint(int4, tmp_path / "kimi")
    cfg = model_config(kimi)
    assert cfg.architecture == "KimiK25ForConditionalGeneration" and isinstance(cfg.weight_quant, PackedInt4Config)
    assert cfg.weight_quant.group_size == 32 and cfg.is_mla
    outs = LLM(str(kimi), block_size=8, max_model_len=96).generate(
        [{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == reference("int4-deepseek_v3")[1]
