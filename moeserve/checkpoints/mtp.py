"""Multi-token prediction layers added to a saved checkpoint, as the releases store them.

DeepSeek-V3, GLM-4.5 and their sparse-attention successors (DeepSeek-V3.2, GLM-5): config.json's
`num_nextn_predict_layers`, and for MTP layer i, decoder layer `num_hidden_layers + i` with
`embed_tokens`, `enorm`, `hnorm`, `eh_proj` `[H, 2H]`, a full decoder layer (attention, with its
indexer where the target has one, + MoE) and `shared_head.norm` / `shared_head.head`, in a
safetensors file of their own listed by `model.safetensors.index.json`. Qwen3-Next and Qwen3.5
store one such layer under other names (`write_qwen_mtp_layer`), over the target's embedding and
head.

transformers' model classes neither build nor load these layers (they ignore the extra layer
indices), so the target's parity is untouched. The decoder layers come from a helper model of the
same architecture, built and saved by transformers (the experts in the layout it saves the target's).

`mtp_init="aligned"` builds layers that agree with the target often, so speculative decoding's
benchmark and tests see drafts accepted. Each MTP layer is a copy of the target's last decoder
layer (Qwen's: its last full-attention layer), with the target's embedding, final norm and head;
`eh_proj` passes the next token's embedding through and drops the hidden state (`[I, 0]`), and
`enorm`'s weight is the embedding rows' mean RMS, which undoes its normalisation up to each row's
own spread. At position p the layer then computes what the target's last layer computes at p + 1
over the next token, and its keys at q are the target's at q + 1: rotary attention sees the same
relative positions, so for a one-layer target the MTP logits are the target's at the next
position, but for attention to the first token (which no MTP key holds): its drafts are then
mostly right. The more layers a target has, the less a copy of its last one predicts it.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedConfig

from moeserve.checkpoints.spec import HYBRID_ARCHS, MakeModelSpec

MTP_FILE = "model-mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_mtp_layers(
    spec: MakeModelSpec,
    make_config: Callable[[MakeModelSpec], PreTrainedConfig],
    out: Path,
) -> None:
    """Add `spec.mtp_layers` MTP layers to the checkpoint saved in `out` (`make_config`: the
    architecture's config for a spec)."""
    if spec.arch in HYBRID_ARCHS:
        _write_qwen_layer(spec, make_config, out)
        return
    target = _read_all(out)
    helper_layers = spec.first_k_dense_replace + spec.mtp_layers
    helper = _helper_layers(spec, make_config, helper_layers) if spec.mtp_init == "random" else {}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(spec.mtp_layers):
        if spec.mtp_init == "aligned":
            own = _aligned(_layer(target, spec.layers - 1), target)
        else:
            own = _random(_layer(helper, spec.first_k_dense_replace + i), target, spec.init_std)
        tensors.update({f"model.layers.{spec.layers + i}.{name}": t.contiguous() for name, t in own.items()})
    _save(out, tensors, {"num_nextn_predict_layers": spec.mtp_layers})


def write_qwen_mtp_layer(out: Path) -> None:
    """Add an aligned MTP layer, as Qwen3-Next and Qwen3.5 release theirs (`mtp.fc`,
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.`, `mtp.norm`), to the
    text checkpoint transformers saved in `out`: the `_aligned` recipe over the target's last
    full-attention layer (which any layer count and layer schedule has), its final norm the
    target's."""
    target = _read_all(out)
    config = json.loads((out / "config.json").read_text())
    last_full = max(i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    layer = _layer(target, last_full)
    own = _as_qwen(layer, _aligned(layer, target), target["model.norm.weight"].clone())
    _save_qwen(out, own, config["model_type"])


def _write_qwen_layer(spec: MakeModelSpec, make_config: Callable[[MakeModelSpec], PreTrainedConfig], out: Path) -> None:
    """make-model's Qwen MTP layer: aligned as `write_qwen_mtp_layer` makes it, or random, its
    decoder layer a one-layer helper's (whose only layer is full attention, as an MTP layer's)."""
    if spec.mtp_init == "aligned":
        write_qwen_mtp_layer(out)
        return
    target = _read_all(out)
    layer = _layer(_helper_layers(spec, make_config, 1), 0)
    own = _as_qwen(layer, _random(layer, target, spec.init_std), torch.zeros_like(target["model.norm.weight"]))
    _save_qwen(out, own, spec.arch)


def _as_qwen(
    layer: dict[str, torch.Tensor], own: dict[str, torch.Tensor], norm: torch.Tensor
) -> dict[str, torch.Tensor]:
    """An MTP layer made in DeepSeek's names (`_random`, `_aligned`) over `layer`, in Qwen's: its
    norms zero-centred (a scale of 1 + w, as the target's), `norm` before the target's own head and
    embedding, which Qwen's layer reads instead of storing copies."""
    return {
        "fc.weight": own["eh_proj.weight"],
        "pre_fc_norm_embedding.weight": own["enorm.weight"] - 1,
        "pre_fc_norm_hidden.weight": own["hnorm.weight"] - 1,
        "norm.weight": norm,
        **{f"layers.0.{name}": t for name, t in layer.items()},
    }


def _save_qwen(out: Path, own: dict[str, torch.Tensor], model_type: str) -> None:
    """Save a Qwen MTP layer under `mtp.`, its count under the key each release's config uses."""
    key = "num_nextn_predict_layers" if model_type == "qwen3_next" else "mtp_num_hidden_layers"
    _save(out, {f"mtp.{name}": t.contiguous() for name, t in own.items()}, {key: 1})


def write_v4_mtp_block(out: Path) -> None:
    """Add an aligned MTP block, as DeepSeek-V4 releases it (`mtp.0.`: `enorm`, `hnorm`, `e_proj`,
    `h_proj`, a window-only block, `hc_head_fn` / `_base` / `_scale`, `norm`), to the checkpoint
    transformers saved in `out`: the `_aligned` recipe over the target's last layer (learned
    routing), less its compressor and indexer. `e_proj` passes the next token's embedding to every
    stream, as the target's embedding enters its first layer, `h_proj` drops the target's streams,
    and the block's hyper head and norm are the target's, so it predicts what a one-layer target
    would after the next token: where the tiny target's streams are mostly its last token's
    embedding, that is often the target's own next prediction."""
    target = _read_all(out)
    config = json.loads((out / "config.json").read_text())
    layer = _layer(target, config["num_hidden_layers"] - 1)
    if "ffn.gate.bias" not in layer:
        raise ValueError("the aligned V4 MTP block copies the target's last layer, which must route by scores")
    embedding = target["model.embed_tokens.weight"]
    hidden, dtype = embedding.shape[1], embedding.dtype
    row_rms = embedding.float().pow(2).mean(-1).sqrt().mean()
    own = {name: t for name, t in layer.items() if not name.startswith(("attn.compressor.", "attn.indexer."))}
    own.update(
        {
            "enorm.weight": torch.full((hidden,), float(row_rms), dtype=dtype),
            "hnorm.weight": torch.ones(hidden, dtype=dtype),
            "e_proj.weight": torch.eye(hidden, dtype=dtype),
            "h_proj.weight": torch.zeros(hidden, hidden, dtype=dtype),
            "norm.weight": target["model.norm.weight"].clone(),
            **{f"hc_head_{part}": target[f"model.hc_head.hc_{part}"].clone() for part in ("fn", "base", "scale")},
        }
    )
    _save(out, {f"mtp.0.{name}": t.contiguous() for name, t in own.items()}, {"num_nextn_predict_layers": 1})


def _save(out: Path, tensors: dict[str, torch.Tensor], config_keys: dict[str, int]) -> None:
    """Write the MTP tensors to their own file, list them in the index, set `config_keys`."""
    save_file(tensors, str(out / MTP_FILE), metadata={"format": "pt"})
    _add_to_index(out, list(tensors))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(config_keys)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _helper_layers(
    spec: MakeModelSpec, make_config: Callable[[MakeModelSpec], PreTrainedConfig], layers: int
) -> dict[str, torch.Tensor]:
    """The tensors of a helper model of `layers` layers of the spec's architecture, whose layers
    supply the random MTP layers: drawn from a seed of their own, so the target's weights are those
    of the same spec without MTP, and saved by transformers in the hub's layout."""
    helper_spec = dataclasses.replace(spec, layers=layers, mtp_layers=0)
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(spec.seed + 1)
        helper = AutoModelForCausalLM.from_config(make_config(helper_spec), dtype=getattr(torch, spec.dtype))
        helper.save_pretrained(tmp)
        return _read_all(Path(tmp))


def _random(
    layer: dict[str, torch.Tensor], target: dict[str, torch.Tensor], init_std: float
) -> dict[str, torch.Tensor]:
    """A random MTP layer (the decoder layer as the helper drew it), over the target's embedding."""
    hidden = target["model.norm.weight"].shape[0]
    dtype = target["model.norm.weight"].dtype
    return {
        **layer,
        "embed_tokens.weight": target["model.embed_tokens.weight"].clone(),
        "enorm.weight": torch.ones(hidden, dtype=dtype),
        "hnorm.weight": torch.ones(hidden, dtype=dtype),
        "eh_proj.weight": (torch.randn(hidden, 2 * hidden) * init_std).to(dtype),
        "shared_head.norm.weight": torch.ones(hidden, dtype=dtype),
        "shared_head.head.weight": _head(target).clone(),
    }


def _aligned(layer: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MTP layer built to agree with the target often (see the module's docstring)."""
    embedding = target["model.embed_tokens.weight"]
    hidden, dtype = embedding.shape[1], embedding.dtype
    row_rms = embedding.float().pow(2).mean(-1).sqrt().mean()
    return {
        **_random(layer, target, 1.0),
        "enorm.weight": torch.full((hidden,), float(row_rms), dtype=dtype),
        "eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1).to(dtype),
        "shared_head.norm.weight": target["model.norm.weight"].clone(),
    }


def _layer(tensors: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s tensors, by their names within the layer."""
    prefix = f"model.layers.{index}."
    return {name[len(prefix) :]: t.clone() for name, t in tensors.items() if name.startswith(prefix)}


def _head(target: dict[str, torch.Tensor]) -> torch.Tensor:
    return target.get("lm_head.weight", target["model.embed_tokens.weight"])


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint's safetensors files."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _add_to_index(folder: Path, names: list[str]) -> None:
    """List `names` in `MTP_FILE` in the index, writing one for a single-file checkpoint."""
    index_path = folder / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(names, MTP_FILE))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
