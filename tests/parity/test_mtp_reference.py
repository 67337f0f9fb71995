"""DeepSeek-V3's MTP layer computes what its release's modeling code computes: it reads the
target's hidden states after the final norm (`hnorm` was trained on them), and a later draft
reads the MTP layer's own output after `shared_head.norm`.

transformers builds no MTP layer, so the reference is assembled from its parts: the target's
`last_hidden_state` (after `model.norm`), `enorm`/`hnorm`/`eh_proj` written out, and the MTP's
decoder layer as transformers' own `DeepseekV3DecoderLayer` (the checkpoint loaded with one more
layer, so its experts go through transformers' own loading). The final norm's weights are drawn
away from ones: with the ones transformers initialises, the norm before `hnorm` changes nothing,
and reading the stream before it (the bug this guards) went unseen.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.mtp_checkpoints import mtp_checkpoint
from helpers.reference import hf_model
from safetensors.torch import load_file, save_file

from moeserve.models import load_model
from moeserve.ops import attention_batch
from moeserve.worker.kv_cache import allocate_kv_caches

PROMPT_LEN = 23
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A DeepSeek-V3 checkpoint with one random MTP layer, its final norm's weights drawn in
    [0.5, 1.5] and the MTP's `hnorm` and `shared_head.norm` likewise."""
    folder = mtp_checkpoint(tmp_path_factory.mktemp("mtp-ref"), "deepseek_v3", aligned=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    for name in (
        "model.norm.weight",
        f"model.layers.{layers}.hnorm.weight",
        f"model.layers.{layers}.shared_head.norm.weight",
    ):
        path = folder / index[name]
        tensors = load_file(str(path))
        tensors[name] = (0.5 + torch.rand(tensors[name].shape, generator=g)).to(tensors[name].dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def reference_mtp_logits(folder, tmp_path, prompt: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 0 .. len(prompt) - 2 (each predicting the token two
    ahead), as the release's modeling code computes them."""
    target = hf_model(folder)
    config = json.loads((folder / "config.json").read_text())
    layers, eps = config["num_hidden_layers"], config["rms_norm_eps"]
    mtp = {
        k.split(f"model.layers.{layers}.", 1)[1]: v.float()
        for k, v in load_file(str(folder / "model-mtp.safetensors")).items()
    }
    # The MTP's decoder layer, loaded by transformers as one more layer of the target (one file:
    # where a model.safetensors is, transformers reads no index).
    longer = tmp_path / "longer"
    shutil.copytree(folder, longer)
    merged = {**load_file(str(longer / "model.safetensors")), **load_file(str(longer / "model-mtp.safetensors"))}
    save_file(merged, str(longer / "model.safetensors"), metadata={"format": "pt"})
    (longer / "model-mtp.safetensors").unlink()
    (longer / "model.safetensors.index.json").unlink()
    config.update(num_hidden_layers=layers + 1, num_nextn_predict_layers=0)
    (longer / "config.json").write_text(json.dumps(config))
    layer = hf_model(longer).model.layers[layers]

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hidden = target.model(ids).last_hidden_state[0, :-1]  # after model.norm
        embedded = torch.nn.functional.embedding(ids[0, 1:], mtp["embed_tokens.weight"])
        x = torch.cat((_rms(embedded, mtp["enorm.weight"], eps), _rms(hidden, mtp["hnorm.weight"], eps)), -1)
        x = (x @ mtp["eh_proj.weight"].T)[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=target.model.rotary_emb(x, positions),
        )
        out = out[0] if isinstance(out, tuple) else out
        return _rms(out[0], mtp["shared_head.norm.weight"], eps) @ mtp["shared_head.head.weight"].T


def ours_mtp_logits(folder, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, the stream the MTP layer hands a later draft, its normed output) at positions
    0 .. len(prompt) - 2, from one prefill of the target and one pass of its MTP layer."""
    model = load_model(folder, with_mtp=True)
    n = len(prompt)
    tables = [list(range(-(-n // BLOCK)))]
    caches = allocate_kv_caches(model.cfg, len(tables[0]) + 1, BLOCK, model.dtype, "cpu", model.tp.size)
    with torch.inference_mode():
        plan = model.ops.plan_attention(attention_batch(tables, [0], [n], BLOCK, "cpu"))
        _, reads = model.forward_with_stream(torch.tensor(prompt), torch.arange(n), plan, caches)
        plan = model.ops.plan_attention(attention_batch(tables, [0], [n - 1], BLOCK, "cpu"))
        cos, sin = model.rotary.cos_sin(torch.arange(n - 1), model.dtype)
        layer = model.mtp[0]
        stream, normed = layer(reads[:-1], torch.tensor(prompt[1:]), cos, sin, caches[0], plan)
        return layer.logits(normed), stream, normed


def test_mtp_logits_equal_the_release_computation(checkpoint, tmp_path):
    prompt = torch.randint(3, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    ours, stream, normed = ours_mtp_logits(checkpoint, prompt)
    reference = reference_mtp_logits(checkpoint, tmp_path, prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    # A later draft reads the MTP layer's output after shared_head.norm, not its stream before it.
    assert torch.equal(stream, normed)
