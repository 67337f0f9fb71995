"""Where each DeepSeek-V4 parameter lives in a checkpoint, in the released layout's names.

DeepSeek's release names tensors its own way (`layers.N.attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `embed`, `head`), and transformers writes a checkpoint in that layout too, under
`model.` (its embeddings, final norm and hyper head under their module names). Both are read:
`prefix` says which (`layout_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeserve.models.checkpoint import CheckpointReader
from moeserve.models.weight_sources import WeightSource


@dataclass(frozen=True)
class Layout:
    prefix: str  # before `layers.N.`
    top: dict[str, str]  # our top-level parameters -> their tensors


RELEASED = Layout(
    "",
    {
        "embed_tokens": "embed.weight",
        "norm.weight": "norm.weight",
        "lm_head": "head.weight",
        "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base",
        "hc_head.hc_scale": "hc_head_scale",
    },
)
TRANSFORMERS = Layout(
    "model.",
    {
        "embed_tokens": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head": "head.weight",
        "hc_head.hc_fn": "model.hc_head.hc_fn",
        "hc_head.hc_base": "model.hc_head.hc_base",
        "hc_head.hc_scale": "model.hc_head.hc_scale",
    },
)

# Ours (after `layers.N.`) -> theirs, by leading part; the first match wins.
_RENAMES = (
    ("input_norm.", "attn_norm."),
    ("post_attn_norm.", "ffn_norm."),
    ("attn_hc.", "hc_attn_"),
    ("ffn_hc.", "hc_ffn_"),
    ("attn.sinks", "attn.attn_sink"),
    ("attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("attn.compressor.indexer.", "attn.indexer.compressor."),
    ("mlp.router.correction_bias", "ffn.gate.bias"),
    ("mlp.router.", "ffn.gate."),
    ("attn.", "attn."),
)
_LEAVES = {
    "q_a_proj": "wq_a",
    "q_a_norm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "gate_proj": "wgate",
    "kv_norm": "norm",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "position_bias": "ape",
}


def layout_of(reader: CheckpointReader) -> Layout:
    return RELEASED if RELEASED.top["embed_tokens"] in reader else TRANSFORMERS


def v4_source(name: str, layout: Layout, experts_by_layer: dict[int, tuple[int, ...]], num_layers: int) -> WeightSource:
    """The checkpoint tensors behind our parameter `name` (`experts_by_layer`: the checkpoint
    expert in each of this rank's slots, per layer; MTP block i's under `num_layers + i`). MTP
    blocks are read by the released names (`mtp.i.`) whatever the layout: transformers saves none."""
    if name in layout.top:
        return WeightSource.one(layout.top[name])
    mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if mtp is not None:
        index, suffix, p = int(mtp.group(1)), mtp.group(2), f"mtp.{mtp.group(1)}."
        if suffix.startswith("layer."):
            return _layer_source(p, suffix[len("layer.") :], experts_by_layer.get(num_layers + index, ()))
        if suffix.startswith("hc_head.hc_"):
            return WeightSource.one(f"{p}hc_head_{suffix[len('hc_head.hc_') :]}")
        return WeightSource.one(p + suffix)  # enorm, hnorm, e_proj, h_proj, norm
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"no checkpoint mapping for parameter {name!r}")
    layer = int(match.group(1))
    return _layer_source(f"{layout.prefix}layers.{layer}.", match.group(2), experts_by_layer.get(layer, ()))


def _layer_source(p: str, suffix: str, slots: tuple[int, ...]) -> WeightSource:
    """A block's parameter `suffix` under the checkpoint prefix `p`, its experts those in `slots`."""
    experts = [f"{p}ffn.experts.{e}." for e in slots]
    if suffix == "mlp.experts.w13":
        return WeightSource(tuple((f"{e}w1.weight", f"{e}w3.weight") for e in experts), stacked=True)
    if suffix == "mlp.experts.w2":
        return WeightSource(tuple((f"{e}w2.weight",) for e in experts), stacked=True)
    if suffix == "mlp.shared.gate_up":
        return WeightSource(((f"{p}ffn.shared_experts.w1.weight", f"{p}ffn.shared_experts.w3.weight"),))
    if suffix == "mlp.shared.down":
        return WeightSource.one(f"{p}ffn.shared_experts.w2.weight")
    for ours, theirs in _RENAMES:
        if suffix.startswith(ours):
            parts = (theirs + suffix[len(ours) :]).split(".")
            return WeightSource.one(p + ".".join(_LEAVES.get(part, part) for part in parts))
    raise KeyError(f"no checkpoint mapping for layer parameter {suffix!r}")
