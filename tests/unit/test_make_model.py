"""moeserve.checkpoints: the tiny checkpoints load in transformers and hold what the spec says."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from moeserve.api.tool_calls import ToolCallReader
from moeserve.api.tool_parsers import HermesToolParser
from moeserve.checkpoints import (
    SUPPORTED_ARCHS,
    MakeModelSpec,
    builder,
    demo,
    make_model,
    random_demo_model_path,
    train_tokenizer,
)
from moeserve.checkpoints.spec import DSA_ARCHS, GROUPED_ROUTER_ARCHS, HYBRID_ARCHS
from moeserve.checkpoints.tokenizer import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID

# How transformers 5.x saves one expert's weights (fused in memory, one tensor per expert on disk).
EXPERT_WEIGHTS = {
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w2",
        "block_sparse_moe.experts.{e}.w3",
    ),
    "qwen2_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}
EXPERT_WEIGHTS["qwen3_moe"] = EXPERT_WEIGHTS["deepseek_v3"] = EXPERT_WEIGHTS["qwen2_moe"]
EXPERT_WEIGHTS["olmoe"] = EXPERT_WEIGHTS["glm4_moe"] = EXPERT_WEIGHTS["qwen2_moe"]
EXPERT_WEIGHTS["minimax_m2"] = EXPERT_WEIGHTS["mixtral"]
# transformers saves Qwen3.5's experts one tensor per expert too (its releases stack them).
for _arch in ("qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa"):
    EXPERT_WEIGHTS[_arch] = EXPERT_WEIGHTS["qwen2_moe"]
# gpt-oss keeps a layer's experts stacked, as its published bf16 checkpoints do.
FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

ARCHITECTURE = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}  # the text model of the multimodal release
NUM_EXPERTS_FIELD = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "deepseek_v3": "n_routed_experts",
    "olmoe": "num_experts",
    "glm4_moe": "n_routed_experts",
    "minimax_m2": "num_local_experts",
    "gpt_oss": "num_local_experts",
    "qwen3_next": "num_experts",
    "qwen3_5_moe": "num_experts",
    "deepseek_v32": "n_routed_experts",
    "glm_moe_dsa": "n_routed_experts",
}
SMALL_SHARDS = 64 * 1024  # bytes; every default-sized model is several times larger


@pytest.fixture(scope="module", params=SUPPORTED_ARCHS)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[MakeModelSpec, Path]:
    """One sharded float32 model per architecture, shared by the tests of this module."""
    spec = MakeModelSpec(arch=request.param, max_shard_bytes=SMALL_SHARDS)
    return spec, make_model(spec, tmp_path_factory.mktemp(request.param))


def test_loads_in_transformers_and_generates_varied_text(
    built: tuple[MakeModelSpec, Path],
) -> None:
    spec, path = built
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("def main() -> None:", return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], spec.vocab)
    assert torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    out = out[0, ids.shape[1] :]  # [24]
    assert len(set(out.tolist())) > 8, f"greedy text is degenerate: {out.tolist()}"


def test_config_matches_spec_and_tokenizer(built: tuple[MakeModelSpec, Path]) -> None:
    spec, path = built
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.model_type == MODEL_TYPE.get(spec.arch, spec.arch)
    assert config.architectures == [ARCHITECTURE[spec.arch]]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (512, 64, 2)
    assert getattr(config, NUM_EXPERTS_FIELD[spec.arch]) == spec.experts
    assert config.num_experts_per_tok == spec.top_k
    assert config.tie_word_embeddings is False
    assert config.initializer_range == spec.init_std
    special_ids = (BOS_ID, EOS_ID, PAD_ID)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == special_ids
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == special_ids
    assert len(tokenizer) == spec.vocab
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_ID, IM_END_ID]


def test_sharded_with_an_index_and_one_tensor_per_expert(
    built: tuple[MakeModelSpec, Path],
) -> None:
    spec, path = built
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {p.name for p in path.glob("model-*.safetensors")}
    first_moe = spec.first_k_dense_replace if spec.arch in GROUPED_ROUTER_ARCHS else 0
    for layer in range(first_moe, spec.layers):
        if spec.arch == "gpt_oss":
            for weight in FUSED_EXPERT_WEIGHTS:
                assert f"model.layers.{layer}.mlp.experts.{weight}" in index["weight_map"]
            continue
        for e in range(spec.experts):
            for weight in EXPERT_WEIGHTS[spec.arch]:
                assert f"model.layers.{layer}.{weight.format(e=e)}.weight" in index["weight_map"]
    for name, shard in index["weight_map"].items():
        with safe_open(path / shard, "pt") as f:
            assert name in f.keys()


def test_small_model_below_the_threshold_is_one_file(tmp_path: Path) -> None:
    make_model(MakeModelSpec(arch="qwen3_moe"), tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_deepseek_correction_bias_is_random_and_float32(tmp_path: Path) -> None:
    make_model(MakeModelSpec(arch="deepseek_v3", layers=3, dtype="bfloat16"), tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        biases = {k: f.get_tensor(k) for k in f.keys() if k.endswith("e_score_correction_bias")}
        # the model's own weights keep its dtype (not the router's: transformers >= 5.2x keeps
        # DeepSeek's gate.weight in float32 as well)
        assert f.get_tensor("model.layers.1.self_attn.o_proj.weight").dtype == torch.bfloat16
    assert sorted(biases) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    for bias in biases.values():
        assert bias.dtype == torch.float32
        assert (bias != 0).all()
    assert not torch.equal(*biases.values())


def test_same_spec_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    spec = MakeModelSpec(arch="qwen3_moe")
    a = make_model(spec, tmp_path / "a")
    b = make_model(spec, tmp_path / "b")
    c = make_model(MakeModelSpec(arch="qwen3_moe", seed=1), tmp_path / "c")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("layers", "kinds"),
    [(1, "F"), (2, "LF"), (3, "LLF"), (6, "LLLFLL")],
)
def test_hybrid_layers_have_both_kinds_from_two_layers_on(layers: int, kinds: str, tmp_path: Path) -> None:
    """Three DeltaNets per full attention as released, the interval shortened for fewer layers."""
    make_model(MakeModelSpec(arch="qwen3_next", layers=layers), tmp_path)
    layer_types = AutoConfig.from_pretrained(tmp_path).layer_types
    assert "".join("F" if t == "full_attention" else "L" for t in layer_types) == kinds


def test_refuses_a_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "stale.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError):
        make_model(MakeModelSpec(arch="mixtral"), tmp_path)


@pytest.mark.parametrize("vocab_size", [261, 512, 20_000])
def test_tokenizer_round_trips_and_has_exact_size(vocab_size: int, tmp_path: Path) -> None:
    train_tokenizer(vocab_size, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == vocab_size
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == vocab_size
    for text in ["Hello, world!\n\tdef f(x):  return x  ", "héllo wörld — 日本 🙂 e\u0301", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_pads_with_reserved_tokens_when_merges_run_out(tmp_path: Path) -> None:
    train_tokenizer(20_000, tmp_path)
    vocab = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab()
    assert "<|reserved_0|>" in vocab
    assert max(vocab.values()) == 20_000 - 1


def test_chat_template_is_chatml(tmp_path: Path) -> None:
    train_tokenizer(512, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 4
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_chat_template_writes_tools_and_calls_as_the_hermes_parser_reads_them(tmp_path: Path) -> None:
    """Signatures in the system turn, the assistant's calls in <tool_call> blocks (what the
    `hermes` parser reads back to the same calls), and a run of tool results as one user turn."""
    train_tokenizer(512, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    calls = [
        {"id": "a", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sums?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "1"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    system, user, assistant, results, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.\n\n") and json.dumps(tools[0]) in system
    assert user == "user\nSums?<|im_end|>\n" and prompt == "assistant\n"
    assert results == "user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>\n"
    content, read, finish = ToolCallReader("auto", parser=HermesToolParser()).final(
        assistant.removeprefix("assistant\n").removesuffix("<|im_end|>\n"), "stop"
    )
    assert not content and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in read] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": 1}),
    ]


def test_tokenizer_needs_room_for_bytes_and_specials(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(260, tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arch": "llama"}, "arch="),
        ({"arch": "qwen3_moe", "dtype": "int8"}, "dtype="),
        ({"arch": "qwen3_moe", "top_k": 9}, "top_k=9 exceeds"),
        ({"arch": "qwen3_moe", "heads": 4, "kv_heads": 3}, "not a multiple of kv_heads"),
        ({"arch": "qwen3_moe", "head_dim": 15}, "even"),
        ({"arch": "qwen3_moe", "vocab": 100}, "vocab=100"),
        ({"arch": "qwen3_moe", "layers": 0}, "layers=0"),
        ({"arch": "mixtral", "intermediate": 128}, "no dense MLP"),
        (
            {"arch": "qwen3_moe", "shared_expert_intermediate": 64},
            "applies to qwen2_moe, qwen3_next and qwen3_5_moe only",
        ),
        ({"arch": "deepseek_v3", "experts": 8, "n_group": 3}, "not divisible by n_group"),
        ({"arch": "deepseek_v3", "experts": 8, "n_group": 8, "topk_group": 1}, "fewer than 2"),
        ({"arch": "deepseek_v3", "n_group": 4, "topk_group": 1, "top_k": 3}, "top_k=3 exceeds"),
        ({"arch": "deepseek_v3", "layers": 1, "first_k_dense_replace": 1}, "no MoE layer"),
        ({"arch": "glm4_moe", "experts": 8, "n_group": 3}, "not divisible by n_group"),
        ({"arch": "glm4_moe", "head_dim": 18}, "multiple of 4"),
        ({"arch": "olmoe", "heads": 4, "head_dim": 8}, "must equal hidden"),
        ({"arch": "gpt_oss", "intermediate": 128}, "no dense MLP"),
        ({"arch": "gpt_oss", "quantize": "fp8"}, "use quantize=mxfp4"),
        ({"arch": "qwen3_moe", "quantize": "mxfp4"}, "gpt_oss's expert format"),
        ({"arch": "gpt_oss", "quantize": "mxfp4", "hidden": 48}, "multiples of 32"),
        ({"arch": "gpt_oss", "quantize": "int4"}, "quantize='int4'"),
        ({"arch": "mixtral", "quantize": "nvfp4"}, "per-expert gate/up/down projections"),
        ({"arch": "qwen3_moe", "quantize": "int4", "hidden": 48}, "groups of 32"),
        ({"arch": "qwen3_moe", "quantize": "nvfp4", "moe_intermediate": 40}, "multiples of 16"),
        ({"arch": "qwen3_next", "head_dim": 12}, "multiple of 8"),
        ({"arch": "qwen3_5_moe", "intermediate": 128}, "no dense MLP"),
        ({"arch": "qwen3_next", "quantize": "int4"}, "not qwen3_next"),
        ({"arch": "glm_moe_dsa", "quantize": "nvfp4"}, "not glm_moe_dsa"),
        ({"arch": "qwen3_5_moe", "mtp_layers": 2}, "one MTP layer of qwen3_5_moe's"),
        ({"arch": "qwen3_next", "mtp_layers": 2}, "one MTP layer of qwen3_next's"),
        ({"arch": "mixtral", "mtp_layers": 1}, "mixtral has no multi-token prediction layers"),
        ({"arch": "deepseek_v32", "q_lora_rank": 0}, "indexer reads the query latent"),
        ({"arch": "glm_moe_dsa", "layers": 1, "first_k_dense_replace": 1}, "no MoE layer"),
    ],
)
def test_bad_spec_is_a_value_error(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MakeModelSpec(**fields)


def test_demo_model_is_built_once_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="moeserve.checkpoints")
    path = random_demo_model_path()
    assert "building the demo model" in caplog.text
    caplog.clear()
    assert random_demo_model_path() == path
    assert "building" not in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging folder left behind
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.dtype) == ("qwen3_moe", torch.bfloat16)
    assert (path / "model.safetensors.index.json").is_file()


def test_demo_model_race_lost_uses_the_winners_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / f"demo-{demo.DEMO_SPEC.arch}-{demo._demo_key()}"

    def build_while_another_process_wins(spec: MakeModelSpec, out_dir: Path) -> Path:
        make_model(spec, out_dir)
        final.mkdir()  # the other process's rename lands between our build and our rename
        (final / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(builder, "make_model", build_while_another_process_wins)  # the demo imports it on use
    assert random_demo_model_path(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # our staging folder is gone
    assert (final / "config.json").read_text() == "{}"


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MOESERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path / "moeserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "moeserve"


def test_moeserve_loads_it_with_transformers_logits(built: tuple[MakeModelSpec, Path]) -> None:
    """What make-model writes is what moeserve's loader reads: the same next-token logits."""
    from moeserve.models import load_model
    from moeserve.ops import attention_batch

    spec, path = built
    if spec.arch in (*HYBRID_ARCHS, *DSA_ARCHS):
        pytest.skip(
            "DeltaNet state and the DSA indexer's cache are the engine's to lay out: its test below covers them"
        )
    ids = list(range(3, 12))
    ours = load_model(path)
    caches = [torch.zeros(ours.kv_cache_shape(3, 4)) for _ in ours.layers]
    plan = ours.ops.plan_attention(attention_batch([[0, 1, 2]], [0], [len(ids)], 4))
    with torch.inference_mode():
        got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), plan, caches))
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max().item() < 1e-4


def test_moeserve_engine_generates_transformers_greedy_tokens(built: tuple[MakeModelSpec, Path]) -> None:
    """The server's engine on what make-model writes: transformers' greedy tokens, from a prompt
    longer than the sparse-attention archs' top-k so that their indexer picks among the keys."""
    from moeserve import LLM, SamplingParams

    _, path = built
    prompt = list(range(3, 27))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [output] = LLM(str(path), dtype="float32", max_model_len=64).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False
    )
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert list(output.outputs[0].token_ids) == expected[0, len(prompt) :].tolist()
