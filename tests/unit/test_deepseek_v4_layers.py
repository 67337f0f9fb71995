"""DeepSeek-V4's layers against transformers' modules, on random inputs: the hyper-connections and
hyper head, the attention of each kind (window only, CSA with its indexer, HCA), and both MoE
kinds (hash and sqrtsoftplus routing, clamped SwiGLU) through the common MoE block."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_configs import hf_config, randomize_deepseek_v4

from moeserve.cache_spec import PagedSpec
from moeserve.dispatch import LocalDispatcher
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.models.architectures.deepseek_v4 import parse_config
from moeserve.models.decoder import cache_specs
from moeserve.models.layers.moe import MoEBlock
from moeserve.models.layers.router import HashRouter
from moeserve.models.v4.attention import CompressedAttention
from moeserve.models.v4.hyper import HyperConnection, HyperHead, merge
from moeserve.models.v4.model import DeepseekV4CausalLM
from moeserve.models.v4.weights import TRANSFORMERS, v4_source
from moeserve.worker.kv_cache import allocate_kv_caches, state_bytes

SEQ = 45  # several closed windows of both ratios, a few past the CSA top-k, an open one at the end


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config("deepseek_v4")
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_deepseek_v4(model)
    raw = {**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    return model, parse_config(raw)


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    own = dict(module.named_parameters())
    assert set(own) == set(state), set(own) ^ set(state)
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_attention_matches_transformers(reference, layer):
    model, cfg = reference
    theirs = model.model.layers[layer].self_attn
    ours = CompressedAttention(cfg, layer, torch.float32)
    _load(ours, dict(theirs.named_parameters()))
    x = torch.randn(SEQ, cfg.hidden_size)
    positions = torch.arange(SEQ)[None]
    rotary = model.model.rotary_emb
    embeddings = {kind: rotary(x[None], positions, layer_type=kind) for kind in ("main", "compress")}
    distance = positions[0][:, None] - positions[0][None, :]
    mask = torch.where((distance >= 0) & (distance < cfg.compressed_attention.window), 0.0, float("-inf"))
    with torch.no_grad():
        want = theirs(x[None], embeddings, positions, mask[None, None])[0][0]
        got = ours.forward_sequence(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if layer == 1:  # the indexer's choice shapes the output: attending every entry differs
        ours.compressor.indexer.top_k = 10**6
        with torch.no_grad():
            assert not torch.allclose(ours.forward_sequence(x), want, atol=1e-3)


def test_hyper_connections_and_head_match_transformers(reference):
    model, cfg = reference
    hc = cfg.hyper_connections
    streams = torch.randn(SEQ, hc.mult, cfg.hidden_size)
    theirs = model.model.layers[0].attn_hc
    ours = HyperConnection(hc, cfg.hidden_size, cfg.rms_norm_eps)
    _load(ours, dict(theirs.named_parameters()))
    block_out = torch.randn(SEQ, cfg.hidden_size)
    with torch.no_grad():
        post, comb, collapsed = theirs(streams[None])
        want = post[0].unsqueeze(-1) * block_out.unsqueeze(-2) + comb[0].transpose(-1, -2) @ streams
        got_post, got_comb, got_collapsed = ours(streams)
    torch.testing.assert_close(got_collapsed, collapsed[0])
    torch.testing.assert_close(merge(block_out, streams, got_post, got_comb), want)
    torch.testing.assert_close(got_comb.sum(-2), torch.ones(SEQ, hc.mult), atol=1e-4, rtol=0)  # ends on columns
    head = HyperHead(hc, cfg.hidden_size, cfg.rms_norm_eps)
    _load(head, dict(model.model.hc_head.named_parameters()))
    with torch.no_grad():
        torch.testing.assert_close(head(streams), model.model.hc_head(streams[None])[0])


@pytest.mark.parametrize("layer", [0, 2], ids=["hash", "learned"])
def test_moe_block_matches_transformers(reference, layer):
    model, cfg = reference
    theirs = model.model.layers[layer].mlp
    ours = MoEBlock(
        cfg,
        LocalDispatcher(ExpertPlacement.contiguous(cfg.num_experts)),
        torch.float32,
        hash_routed=cfg.hash_moe_layers[layer],
    )
    state = {
        "router.weight": theirs.gate.weight,
        "experts.w13": theirs.experts.gate_up_proj,
        "experts.w2": theirs.experts.down_proj,
        "shared.gate_up": torch.cat([theirs.shared_experts.gate_proj.weight, theirs.shared_experts.up_proj.weight]),
        "shared.down": theirs.shared_experts.down_proj.weight,
    }
    state["router.tid2eid" if cfg.hash_moe_layers[layer] else "router.correction_bias"] = (
        theirs.gate.tid2eid if cfg.hash_moe_layers[layer] else theirs.gate.e_score_correction_bias
    )
    _load(ours, state)
    x = torch.randn(SEQ, cfg.hidden_size) * 4  # large enough for the SwiGLU clamps to bite
    token_ids = torch.randint(0, cfg.vocab_size, (SEQ,))
    with torch.no_grad():
        want = theirs(x[None], input_ids=token_ids[None])[0]
        got = ours(x, token_ids=token_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mtp_block_is_one_more_window_layer_read_by_its_released_names(reference):
    """The MTP block's cache is one more window in the decoder's window group (no group, no state
    of its own), it routes by scores, and its parameters come from the release's `mtp.0.` names
    (its experts those of the slots given for layer `num_layers`), whatever the target's layout."""
    _, cfg = reference
    plain, specs = cache_specs(cfg, torch.float32), cache_specs(cfg, torch.float32, 1, 1)
    window = PagedSpec((), (cfg.head_dim,), "float32", window=cfg.compressed_attention.window)
    assert specs.layers == (*plain.layers, (window,)) and specs.groups == plain.groups
    assert specs.state_bytes_per_sequence == plain.state_bytes_per_sequence
    model = DeepseekV4CausalLM(
        cfg, LocalDispatcher(ExpertPlacement.contiguous(cfg.num_experts)), torch.float32, with_mtp=True
    )
    block = model.mtp[0]
    assert block.layer.attn.compressor is None and not isinstance(block.layer.mlp.router, HashRouter)
    names = {
        name: v4_source(name, TRANSFORMERS, {cfg.num_layers: (5, 1)}, cfg.num_layers).names
        for name, _ in block.named_parameters(prefix="mtp.0")
    }
    assert names["mtp.0.e_proj.weight"] == ["mtp.0.e_proj.weight"]
    assert names["mtp.0.hc_head.hc_scale"] == ["mtp.0.hc_head_scale"]
    assert names["mtp.0.layer.attn.q_a_proj.weight"] == ["mtp.0.attn.wq_a.weight"]
    assert names["mtp.0.layer.attn_hc.fn"] == ["mtp.0.hc_attn_fn"]
    assert names["mtp.0.layer.mlp.experts.w2"] == ["mtp.0.ffn.experts.5.w2.weight", "mtp.0.ffn.experts.1.w2.weight"]
    assert all(n.startswith("mtp.0.") for found in names.values() for n in found)


def test_released_config_form_parses_as_transformers_form(reference):
    """DeepSeek's config.json: per-layer `compress_ratios`, `num_hash_layers`, flat rope keys."""
    model, cfg = reference
    raw = {**model.config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"):
        raw.pop(key)
    raw.update(
        compress_ratios=[0, 4, 128, 4],
        compress_rate_hca=16,  # the tiny model's HCA ratio; released configs say 128
        num_hash_layers=2,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    released = parse_config(raw)
    assert released.compressed_attention == cfg.compressed_attention
    assert (released.rope, released.hash_moe_layers) == (cfg.rope, cfg.hash_moe_layers)


def test_released_tensor_names_load_alike(make_checkpoint, tmp_path):
    """The release's top-level names (`embed`, `hc_head_fn`, no `model.` prefix) and transformers'
    save of the same layout load the same weights."""
    from safetensors.torch import load_file, save_file

    from moeserve.models import load_model

    folder = make_checkpoint("deepseek_v4")
    tensors = load_file(folder / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn"}
    top |= {"model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    released = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(released, tmp_path / "model.safetensors")
    ours, theirs = load_model(folder), load_model(tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_verify_steps_keep_about_one_state_which_the_budget_sets_aside():
    """With 3 drafts (4 tokens a verify step) each slot keeps its compressors' pending rows and
    the step's 4, and their carries (`LayerCache.kept`): the budget sets aside exactly what is
    allocated, less than the 4 states kept after each token would take."""
    config = hf_config("deepseek_v4")
    cfg = parse_config({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    caches = allocate_kv_caches(cfg, 8, 4, torch.float32, "cpu", num_state_slots=2, draft_states=4)
    kept = sum(t.numel() * t.element_size() for cache in caches for t in cache.kept)
    states = state_bytes(cfg, torch.float32, 2)
    assert state_bytes(cfg, torch.float32, 2, draft_states=4) == states + kept
    assert states < kept < 2 * states
