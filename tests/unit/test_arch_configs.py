"""The newer families' config parsers: transformers' defaults where config.json is silent,
clear refusals where it says something moeserve (or transformers) would not compute, and
the one refusal of unsupported quantization methods."""

from __future__ import annotations

import pytest
from helpers.hf_configs import hf_config

from moeserve.config import BlockFP8Config, MXFP4Config
from moeserve.models import CheckpointError
from moeserve.models.architectures import SUPPORTED_QUANT_METHODS, resolve_architecture
from moeserve.ops.triton_ops import TritonOps

HF_NAMES = {
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
}


def raw_config(arch: str, drop: tuple[str, ...] = (), **overrides) -> dict:
    """config.json as transformers writes it for the test model of `arch`."""
    raw = {**hf_config(arch).to_dict(), "architectures": [HF_NAMES[arch]]}
    for key in drop:
        raw.pop(key, None)
    raw.update(overrides)
    return raw


def test_glm_defaults_to_half_rotary_and_reads_its_options():
    raw = raw_config("glm4_moe", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raw.pop("partial_rotary_factor", None)
    _, cfg = resolve_architecture(raw)
    assert (cfg.head_dim, cfg.rope.rotary_dim) == (16, 8)  # Glm4MoeConfig's default factor 0.5
    assert cfg.moe_layers == (False, True) and cfg.shared_expert_intermediate_size == 32
    assert cfg.router.kind == "grouped_sigmoid" and (cfg.router.num_groups, cfg.router.topk_groups) == (2, 1)
    assert cfg.qk_norm == "head" and cfg.qkv_bias and not cfg.o_bias


def test_minimax_rotary_dim_and_remote_code_fields():
    _, cfg = resolve_architecture(raw_config("minimax_m2"))
    assert cfg.rope.rotary_dim == 4 and cfg.qk_norm == "full"
    # The released config.json's legacy rotary_dim, with no partial_rotary_factor beside it.
    legacy = raw_config("minimax_m2", rope_parameters={"rope_type": "default", "rope_theta": 5e6}, rotary_dim=8)
    assert resolve_architecture(legacy)[1].rope.rotary_dim == 8
    assert cfg.router.renormalize and cfg.router.has_correction_bias and cfg.router.num_groups == 1
    with pytest.raises(CheckpointError, match="scoring_func='softmax'"):
        resolve_architecture(raw_config("minimax_m2", scoring_func="softmax"))
    with pytest.raises(CheckpointError, match="qk_norm_type='per_head'"):
        resolve_architecture(raw_config("minimax_m2", qk_norm_type="per_head"))


def test_gpt_oss_defaults_alternate_windows_and_yarn():
    """With no layer_types and no rope settings, transformers' GptOssConfig defaults apply."""
    raw = raw_config("gpt_oss", drop=("layer_types", "rope_parameters", "sliding_window"), num_hidden_layers=4)
    _, cfg = resolve_architecture(raw)
    assert cfg.sliding_windows == (128, None, 128, None)
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta, cfg.rope.truncate) == ("yarn", 32.0, 150000.0, False)
    assert cfg.attention_sinks and cfg.expert_bias and cfg.router.kind == "topk_softmax" and cfg.router.has_bias
    assert (cfg.expert_activation.kind, cfg.expert_activation.limit) == ("clamped_swiglu", 1.0)


def test_hybrid_layer_types_defaults_and_the_multimodal_text_config():
    """Qwen3.5 without layer_types: every fourth layer full attention (transformers' interval);
    Qwen3-Next as written; the multimodal config's text model read from text_config; both with a
    quarter of each head rotating, gated attention and zero-centred norms."""
    _, q35 = resolve_architecture(raw_config("qwen3_5_moe", drop=("layer_types",), num_hidden_layers=8))
    assert q35.linear_layers == (True, True, True, False) * 2
    assert q35.moe_layers == (True,) * 8 and q35.router.renormalize and q35.shared_expert_gated
    assert q35.rope.rotary_dim == 4 and q35.attention_output_gate and q35.zero_centered_norms
    assert not q35.linear_attention.grouped_projections
    _, nxt = resolve_architecture(raw_config("qwen3_next"))
    assert nxt.linear_layers == (True, False, True, False) and nxt.linear_attention.grouped_projections
    _, vl = resolve_architecture(raw_config("qwen3_5_moe_vl"))
    assert (vl.hidden_size, vl.num_layers, vl.linear_attention.value_head_dim) == (64, 4, 12)
    with pytest.raises(CheckpointError, match="layer_types must be 4 of linear_attention / full_attention"):
        resolve_architecture(raw_config("qwen3_next", layer_types=["linear_attention", "sliding_attention"] * 2))


def test_planner_reads_the_hybrids_layer_kinds():
    """The planner's shape counts the DeltaNets `layer_types` names, and their heads."""
    from moeserve.plan.shapes import shape_of

    for arch, linear in (("qwen3_5_moe", 3), ("qwen3_next", 2)):
        shape = shape_of(resolve_architecture(raw_config(arch))[1], "tiny")
        assert (shape.linear_layers, shape.attention_layers) == (linear, 4 - linear)
        assert (shape.linear_key_heads, shape.linear_value_heads) == (2, 4)


def test_olmoe_norm_over_the_whole_projection_and_clip():
    _, cfg = resolve_architecture(raw_config("olmoe", clip_qkv=8))
    assert cfg.qk_norm == "full" and cfg.clip_qkv == 8.0 and not cfg.router.renormalize


def test_rotary_wider_than_a_head_is_refused():
    with pytest.raises(CheckpointError, match="rotary dim 32 must be even and in"):
        resolve_architecture(
            raw_config("minimax_m2", rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 2.0})
        )


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "torchao", "quark"])
def test_unsupported_quantization_names_itself_and_the_supported_ones(method):
    assert method not in SUPPORTED_QUANT_METHODS
    raw = raw_config("qwen3_moe", quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(CheckpointError) as err:
        resolve_architecture(raw)
    assert f"quant_method {method!r} is not supported" in str(err.value)
    assert "supported quant methods: fp8" in str(err.value)


def test_mxfp4_is_read_for_gpt_oss_only():
    """MXFP4 (published gpt-oss) is gpt-oss's expert format: other architectures declaring it are
    refused by name; a malformed modules_to_not_convert is refused too."""
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    assert isinstance(
        resolve_architecture(raw_config("gpt_oss", quantization_config=mxfp4))[1].weight_quant, MXFP4Config
    )
    with pytest.raises(CheckpointError, match="gpt-oss's experts only .*not Qwen3MoeForCausalLM"):
        resolve_architecture(raw_config("qwen3_moe", quantization_config=mxfp4))
    with pytest.raises(CheckpointError, match="modules_to_not_convert should be a list of names"):
        resolve_architecture(raw_config("gpt_oss", quantization_config={**mxfp4, "modules_to_not_convert": "lm_head"}))


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}


def test_fp8_block_config_is_read_and_its_other_forms_refused():
    assert resolve_architecture(raw_config("qwen3_moe", quantization_config=FP8))[1].weight_quant.block == (128, 64)
    assert resolve_architecture(raw_config("qwen3_moe"))[1].weight_quant is None
    for change, message in [
        ({"weight_block_size": None}, "per-tensor scales"),
        ({"activation_scheme": "static"}, "only dynamic activation scales"),
        ({"fmt": "e5m2"}, "only e4m3 weights"),
        ({"weight_block_size": [128]}, "two positive ints"),
        ({"scale_fmt": "e5m2"}, "scale_fmt 'e5m2': only 'float' and 'ue8m0'"),
        ({"expert_dtype": "int4"}, "expert_dtype 'int4': only 'fp8' and 'fp4'"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            resolve_architecture(raw_config("qwen3_moe", quantization_config={**FP8, **change}))


def test_fp8_ue8m0_scales_and_fp4_experts_are_read_where_v4_and_v41_declare_them():
    """DeepSeek-V4 says `expert_dtype` at the top level, V4.1 inside quantization_config."""
    ue8m0 = {**FP8, "scale_fmt": "ue8m0"}
    top = resolve_architecture(raw_config("qwen3_moe", quantization_config=ue8m0, expert_dtype="fp4"))[1]
    inside = resolve_architecture(raw_config("qwen3_moe", quantization_config={**ue8m0, "expert_dtype": "fp4"}))[1]
    assert top.weight_quant == inside.weight_quant == BlockFP8Config((128, 64), ue8m0=True, fp4_experts=True)
    plain = resolve_architecture(raw_config("qwen3_moe", quantization_config=FP8))[1].weight_quant
    assert not plain.ue8m0 and not plain.fp4_experts


def test_triton_backend_takes_fp8_weights_whose_k_block_its_w8a8_kernels_tile():
    assert TritonOps.supports_model(resolve_architecture(raw_config("glm4_moe", quantization_config=FP8))[1]) is None
    odd = {**FP8, "weight_block_size": [128, 96]}  # a K tile of 96 is no Triton block
    reason = TritonOps.supports_model(resolve_architecture(raw_config("glm4_moe", quantization_config=odd))[1])
    assert reason is not None and "FP8" in reason and "96" in reason and "kernels=torch" in reason


def test_triton_backend_refuses_gpt_oss_by_reason_and_takes_the_others():
    for arch in ("olmoe", "glm4_moe", "minimax_m2", "qwen3_moe"):
        assert TritonOps.supports_model(resolve_architecture(raw_config(arch))[1]) is None, arch
    reason = TritonOps.supports_model(resolve_architecture(raw_config("gpt_oss"))[1])
    assert reason is not None and "attention sinks" in reason
