"""The MTP layer computes what transformers' own MTP (`MtpModel`, which its `generate(use_mtp=True)`
drafts with) computes for DeepSeek-V3 and GLM-4.5: it reads the target's hidden states after the
final norm (`hnorm` was trained on them), and a later draft reads the MTP layer's own output after
`shared_head.norm`.

The final norm's weights, `hnorm`'s and `shared_head.norm`'s are drawn away from one: with the ones
transformers initialises, a norm before `hnorm` changes nothing, and reading the stream before the
final norm (the bug this guards: logits 4.0 off for DeepSeek-V3, 3.4 for GLM-4.5) went unseen.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def prompt() -> list[int]:
    return torch.randint(3, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()


def checkpoint(root: Path, arch: str) -> Path:
    """`arch`'s checkpoint with one random MTP layer, the final norm's, `hnorm`'s and
    `shared_head.norm`'s weights drawn in [0.5, 1.5]."""
    folder = mtp_checkpoint(root, arch, aligned=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = f"model.layers.{json.loads((folder / 'config.json').read_text())['num_hidden_layers']}."
    g = torch.Generator().manual_seed(5)
    for name in ("model.norm.weight", mtp + "hnorm.weight", mtp + "shared_head.norm.weight"):
        path = folder / index[name]
        tensors = load_file(str(path))
        tensors[name] = (0.5 + torch.rand(tensors[name].shape, generator=g)).to(tensors[name].dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def one_file(folder: Path, out: Path) -> Path:
    """A copy of `folder` with its MTP tensors in model.safetensors: where that file is,
    transformers reads no index, and MtpModel looks for them in the files transformers reads."""
    shutil.copytree(folder, out)
    merged = {**load_file(str(out / "model.safetensors")), **load_file(str(out / "model-mtp.safetensors"))}
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model-mtp.safetensors").unlink()
    (out / "model.safetensors.index.json").unlink()
    return out


def ours(folder: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the hidden state the MTP layer hands a later draft) at positions 0 .. len(ids) - 2,
    from one prefill of the target and one pass of its MTP layer."""
    model = load_model(folder, with_mtp=True)
    n = len(ids)
    tables = [list(range(-(-n // BLOCK)))]
    caches = allocate_kv_caches(model.cfg, len(tables[0]), BLOCK, model.dtype, "cpu", model.tp.size, mtp_layers=1)
    with torch.inference_mode():
        plan = model.ops.plan_attention(attention_batch(tables, [0], [n], BLOCK, "cpu"))
        _, reads = model.forward_with_stream(torch.tensor(ids), torch.arange(n), plan, caches)
        plan = model.ops.plan_attention(attention_batch(tables, [0], [n - 1], BLOCK, "cpu"))
        cos, sin = model.rotary.cos_sin(torch.arange(n - 1), model.dtype)
        layer = model.mtp[0]
        recycled, normed = layer(reads[:-1], torch.tensor(ids[1:]), cos, sin, caches[model.cfg.num_layers], plan)
        return layer.logits(normed), recycled


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_equals_transformers_mtp_model(tmp_path_factory, arch):
    from transformers.modeling_layers import MtpModel

    folder = checkpoint(tmp_path_factory.mktemp(f"mtp-{arch}"), arch)
    ids = prompt()
    logits, recycled = ours(folder, ids)

    target = hf_model(one_file(folder, tmp_path_factory.mktemp(f"{arch}-one") / "one"))
    # MtpModel finds MTP keys by the released layer counts (61; 46, 92); this checkpoint's is its own.
    target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{target.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(target).eval()
    with torch.inference_mode():
        hidden = target.model(torch.tensor([ids])).last_hidden_state
        positions = torch.arange(len(ids) - 1)[None]
        out = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=torch.tensor([ids[1:]]))
        reference = mtp._project_to_logits(out)[0]
    assert (logits - reference).abs().max().item() < 1e-3
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    assert (recycled - out[0]).abs().max().item() < 1e-4  # the next draft's input: the output after post_norm
