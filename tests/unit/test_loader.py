"""The checkpoint loader: expert subsets, sharding, dtypes, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.dispatch import Dispatcher, ExpertPlacement
from moeserve.models import CheckpointError, load_model, supported_architectures
from moeserve.models.checkpoint import CheckpointReader


class UnusedDispatcher(Dispatcher):
    """Stands in for an EP backend: these tests load weights and never run a forward pass."""

    name = "unused"

    def dispatch(self, hidden, topk_ids, topk_weights):
        raise AssertionError("not used")

    def combine(self, expert_output, handle):
        raise AssertionError("not used")


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A DeepSeek-style checkpoint split over several safetensors shards with an index."""
    folder = tmp_path_factory.mktemp("sharded") / "ckpt"
    make_model(
        MakeModelSpec(arch="deepseek_v3", layers=3, experts=8, top_k=2, vocab=320, max_shard_bytes=64 * 1024), folder
    )
    assert (folder / "model.safetensors.index.json").exists()
    return folder


def test_materialising_half_the_experts_holds_half_the_expert_bytes(sharded, monkeypatch):
    read: list[str] = []
    original = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read.append(name) or original(self, name))
    full = load_model(sharded)
    read.clear()
    half = load_model(sharded, dispatcher=UnusedDispatcher(ExpertPlacement.contiguous(8, ep_size=2, rank=1)))
    assert half.layers[1].mlp.experts.w13.shape[0] == 4
    assert expert_bytes(half) * 2 == expert_bytes(full)
    # Rank 1 holds experts 4..7; experts 0..3 are never read.
    expert_reads = [n for n in read if ".experts." in n]
    assert expert_reads and all(int(n.split(".experts.")[1].split(".")[0]) >= 4 for n in expert_reads)
    # Its experts are exactly the full model's experts 4..7.
    torch.testing.assert_close(half.layers[1].mlp.experts.w13, full.layers[1].mlp.experts.w13[4:], rtol=0, atol=0)


def test_dtypes(sharded):
    bf16 = load_model(sharded, dtype=torch.bfloat16)
    assert bf16.embed_tokens.dtype == torch.bfloat16
    # DeepSeek's gate and correction bias stay float32, as in the reference.
    assert bf16.layers[1].mlp.router.correction_bias.dtype == torch.float32
    assert bf16.layers[1].mlp.router.weight.dtype == torch.float32


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def single_file(make_checkpoint, tmp_path):
    return copy_checkpoint(make_checkpoint("qwen3_moe", 0), tmp_path / "ckpt")


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def rewrite_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_missing_tensor_is_named(single_file):
    rewrite_weights(single_file, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(single_file)


def test_wrong_shape_is_named(single_file):
    def transpose(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].T.contiguous()

    rewrite_weights(single_file, transpose)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[64, 32\], expected \[32, 64\]"
    ):
        load_model(single_file)


def test_missing_config_key_is_named(single_file):
    rewrite_config(single_file, lambda c: c.pop("moe_intermediate_size"))
    with pytest.raises(CheckpointError, match="config.json is missing 'moe_intermediate_size'"):
        load_model(single_file)


def test_unsupported_architecture_lists_the_supported_ones(single_file):
    rewrite_config(single_file, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(CheckpointError) as err:
        load_model(single_file)
    assert "LlamaForCausalLM" in str(err.value)
    for name in supported_architectures():
        assert name in str(err.value)


def test_quantized_checkpoint_is_refused_clearly(single_file):
    rewrite_config(single_file, lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(CheckpointError, match="fp8"):
        load_model(single_file)


def test_missing_folder_and_missing_shard(tmp_path, sharded):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    broken = copy_checkpoint(sharded, tmp_path / "broken")
    next(broken.glob("model-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard files listed"):
        load_model(broken)


def test_checkpoint_errors_are_value_errors():
    assert issubclass(CheckpointError, ValueError)


def test_triton_backend_refusal_reaches_the_loader(make_checkpoint):
    """A model whose layers a backend cannot compute fails at load, naming the reason."""
    from moeserve.ops.triton_ops import TritonOps

    folder = make_checkpoint("gpt_oss", 0)
    with pytest.raises(ValueError, match="GptOssForCausalLM cannot run on kernels=triton: .*attention sinks"):
        load_model(folder, ops=TritonOps())
