"""DeepSeek-V4 served by the engine against transformers: greedy tokens of a checkpoint
transformers writes, mixing a window-only layer, two CSA layers (4 tokens per entry, top 3
entries per query) and an HCA layer (16 per entry), hash-routed and learned MoE layers, a window
of 8. Prompts of 40 and 200 tokens, prefilled in chunks of 16 then decoded, each request's block
tables per group handed out by the scheduler (`block_groups`), the window group's pool too small
for the prompts unless blocks behind the window go back; no block is held at the end. On one
rank, then over `--ep 4` (and `--tp 2`, attention replicated on each pair of ranks).

The same checkpoint rewritten as DeepSeek's release lays it out (FP8 linears with e8m0 scales,
FP4 experts) is served against transformers on its dequantized twin."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model
from helpers.stats import CountingStatLogger
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from moeserve import LLM, SamplingParams
from moeserve.checkpoints.mtp import write_v4_mtp_block
from moeserve.checkpoints.quantize_v4 import quantize_checkpoint, write_dequantized_twin
from moeserve.models import load_model
from moeserve.models.checkpoint import CheckpointError
from moeserve.models.fp8 import BlockFP8, stored_weight
from moeserve.models.packed import PackedWeight
from moeserve.models.v4.compressor import Compressor
from moeserve.spec_decode.ngram import NgramProposer
from moeserve.spec_decode.stats import SpecDecodeStats

PROMPT_LENGTHS = (40, 200)
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256, block_size=4)
DRAFTS = 3
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("deepseek_v4")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(44)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def prompts_and_tokens(checkpoint):
    reference = hf_model(checkpoint)
    return _prompts(), [hf_greedy_tokens(reference, p, NEW_TOKENS) for p in _prompts()]


@pytest.fixture(scope="module")
def released(checkpoint, tmp_path_factory):
    """(the checkpoint in the released FP8 + FP4-experts layout, its dequantized twin's greedy tokens)."""
    root = tmp_path_factory.mktemp("v4-released")
    folder = shutil.copytree(checkpoint, root / "released")
    quantize_checkpoint(folder)
    twin = hf_model(write_dequantized_twin(folder, root / "dequantized"))
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stored = {n: f.get_tensor(n) for n in f.keys()}
    # The twin's values are what transformers itself decodes from the stored bytes and scales.
    decode = Fp8Dequantize(None)._dequantize_one
    for name, param in (
        ("layers.2.attn.wq_a", "model.layers.2.self_attn.q_a_proj"),
        ("layers.2.ffn.experts.5.w2", None),
    ):
        value = decode(stored[f"{name}.weight"], stored[f"{name}.scale"], torch.float32)
        if param is not None:
            assert torch.equal(twin.get_parameter(f"{param}.weight"), value)
        else:  # the experts fused: expert 5's down projection
            assert torch.equal(twin.model.layers[2].mlp.experts.down_proj[5], value)
    return folder, [hf_greedy_tokens(twin, p, NEW_TOKENS) for p in _prompts()]


def _generate_without_leaks(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens; every group's pool whole again afterwards, each window pool too small for
    the longest sequence had nothing gone back."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    longest = max(map(len, prompts)) + NEW_TOKENS
    for scheduler in llm.engine.scheduler.groups:
        window_pools = [n for (_, window), n in scheduler.config.block_groups if window is not None]
        assert window_pools and all(n * ENGINE["block_size"] < longest for n in window_pools)
        assert scheduler.block_manager.num_used_blocks == 0
    usage = llm.engine.scheduler.group_blocks  # what /metrics labels by group: every data-parallel group's
    assert [g.group for g in usage] == ["window", "compressed_4", "compressed_16"] and not any(g.used for g in usage)
    pools = [n for scheduler in llm.engine.scheduler.groups for _, n in scheduler.config.block_groups]
    assert sum(g.total for g in usage) == llm.engine.scheduler.num_kv_blocks == sum(pools)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_match_transformers_in_chunks_and_from_the_prefix_cache(checkpoint, prompts_and_tokens):
    """The 40-token prompt beside a first request holding the 200-token prompt's first 150 tokens,
    then the 200-token prompt: a hit resumes only at a block boundary of every group (block 4 x 16
    positions per entry: every 64 positions) where the open windows' states were saved (the first
    request's prompt mark), so it resumes at 128 from that request's entries, the window blocks it
    gave back as its window moved, and its saved states."""
    prompts, want = prompts_and_tokens
    counts = CountingStatLogger()
    with LLM(str(checkpoint), enable_prefix_caching=True, stat_loggers=[counts], **ENGINE) as llm:
        assert _generate_without_leaks(llm, [prompts[0], prompts[1][:150]])[0] == want[0]
        assert counts.prefix_cache_hits == 0
        assert _generate_without_leaks(llm, [prompts[1]]) == [want[1]]
        assert counts.prefix_cache_hits == 128
        states, saved = llm.engine.executor.runner.states, llm.engine.scheduler.groups[0].block_manager.saved_states
        assert states.num_free >= states.num_slots - 1  # the last to finish gives its slot back at the next plan
        assert saved.num_pending == 0 and saved.num_held > 0


@pytest.mark.parametrize("tp", [1, 2], ids=["ep4", "ep4-tp2"])
def test_expert_parallel_greedy_tokens_match_transformers(checkpoint, prompts_and_tokens, tp):
    """Both prompts spread over the data-parallel groups, each group's MoE over every rank."""
    prompts, want = prompts_and_tokens
    with LLM(str(checkpoint), ep=4, tp=tp, **ENGINE) as llm:
        assert _generate_without_leaks(llm, prompts) == want


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 2)], ids=["ep2", "ep4-tp2"])
def test_two_batch_overlap_greedy_tokens_match_transformers(checkpoint, prompts_and_tokens, ep, tp):
    """Two-batch overlap: the 40-token prompt twice and the 200-token one, so the least-loaded
    routing gives one data-parallel group both short prompts (two micro-batches of one sequence
    each) and the other the long one alone (its second micro-batch empty at every step, joining
    each hash-routed and learned layer's dispatch and combine all the same, and under `--tp 2`
    the group's gathers in the same order on both ranks)."""
    (short, long), (want_short, want_long) = prompts_and_tokens
    with LLM(str(checkpoint), ep=ep, tp=tp, two_batch_overlap=True, **ENGINE) as llm:
        got = _generate_without_leaks(llm, [short, long, short])
    assert got == [want_short, want_long, want_short]


def _generate_with_drafts(
    monkeypatch, checkpoint, prompts_and_tokens, **layout
) -> tuple[LLM, list[int], SpecDecodeStats]:
    """The 40-token prompt's greedy tokens with n-gram drafts (3 a step), no block left held, and
    the drafts counted. The proposer drafts transformers' greedy tokens, every fifth one wrong (a
    random model's output seldom repeats itself), so drafts are kept and rejected at every offset
    in the compressors' windows (4 and 16 tokens)."""
    (prompt, _), (want, _) = prompts_and_tokens

    def oracle(self, num_tokens):
        first = self.num_tokens - len(prompt)  # the output index of the token after the sequence's last
        return [t + (i % 5 == 2) for i, t in enumerate(want[first : first + num_tokens], first)]

    monkeypatch.setattr(NgramProposer, "propose", oracle)
    counts = CountingStatLogger()
    ngram = {"method": "ngram", "num_speculative_tokens": DRAFTS}
    with LLM(str(checkpoint), speculative_config=ngram, stat_loggers=[counts], **layout, **ENGINE) as llm:
        tokens = _generate_without_leaks(llm, [prompt])[0]
    return llm, tokens, counts.spec_decode


def test_drafts_step_the_open_windows_back(checkpoint, prompts_and_tokens, monkeypatch):
    """n-gram drafts verified through every cache group: the tokens stay transformers', some
    rejection came after a window closed on a rejected draft (the open window and carry then step
    back to the last kept token, its entry rewritten when the right tokens close it), and neither
    a block nor a state slot is left held."""
    step_back, stepped = Compressor.step_back, []

    def spy(self, start, accepted, *args):
        verified = start - 1 - accepted  # the verify step's first position
        stepped.append(start // self.ratio < (verified + 1 + DRAFTS) // self.ratio)  # the window `start` is in closed
        step_back(self, start, accepted, *args)

    monkeypatch.setattr(Compressor, "step_back", spy)
    llm, tokens, drafted = _generate_with_drafts(monkeypatch, checkpoint, prompts_and_tokens)
    assert tokens == prompts_and_tokens[1][0]
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens and any(stepped)
    assert len(llm.engine.executor.runner.states.request_ids) <= 1  # a slot goes back with the next plan


def test_drafts_over_expert_and_tensor_parallel_ranks(checkpoint, prompts_and_tokens, monkeypatch):
    """`--ep 4 --tp 2`: the group's first rank judges the drafts, every rank steps its open windows
    back from the next step's start positions alone, to transformers' tokens."""
    _, tokens, drafted = _generate_with_drafts(monkeypatch, checkpoint, prompts_and_tokens, ep=4, tp=2)
    assert tokens == prompts_and_tokens[1][0]
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens


def test_mtp_drafts_through_every_cache_group(checkpoint, prompts_and_tokens, tmp_path):
    """The MTP block (`write_v4_mtp_block`, on a copy) drafting 2 tokens a step, its window cache in
    the decoder's window group: transformers' tokens, no block or state slot left held. A copy of
    its last layer predicts this 4-layer target poorly, so most drafts are rejected and the
    compressors step back past them at almost every step."""
    (prompt, _), (want, _) = prompts_and_tokens
    folder = shutil.copytree(checkpoint, tmp_path / "mtp")
    write_v4_mtp_block(folder)
    counts = CountingStatLogger()
    with LLM(str(folder), speculative_config=MTP, stat_loggers=[counts], **ENGINE) as llm:
        assert _generate_without_leaks(llm, [prompt]) == [want]
        assert len(llm.engine.executor.runner.states.request_ids) <= 1  # a slot goes back with the next plan
    drafted = counts.spec_decode
    assert drafted.num_draft_tokens >= NEW_TOKENS // 2 and drafted.num_accepted_tokens < drafted.num_draft_tokens


def test_aligned_mtp_block_drafts_are_accepted_over_expert_and_tensor_parallel_ranks(make_checkpoint, tmp_path):
    """A target whose first layer (CSA) adds nothing to the streams (its output projections zero:
    its compressors and indexer still run, cache and step back) and whose last is a window layer:
    the MTP block copying that last layer computes what the target does one position on, so its
    drafts are kept, and the tokens stay transformers'. Over `--ep 4 --tp 2`: every rank drafts
    alike, and the idle data-parallel group makes its empty passes in lockstep."""
    folder = shutil.copytree(
        make_checkpoint(
            "deepseek_v4",
            num_hidden_layers=2,
            layer_types=["compressed_sparse_attention", "sliding_attention"],
            mlp_layer_types=["hash_moe", "moe"],
        ),
        tmp_path / "aligned",
    )
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for name in [n for n in tensors if n.startswith("model.layers.0.") and n.endswith(("wo_b.weight", "w2.weight"))]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    prompt = _prompts()[0]
    want = hf_greedy_tokens(hf_model(folder), prompt, NEW_TOKENS)
    write_v4_mtp_block(folder)
    counts = CountingStatLogger()
    with LLM(str(folder), speculative_config=MTP, stat_loggers=[counts], ep=4, tp=2, **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert all(s.block_manager.num_used_blocks == 0 for s in llm.engine.scheduler.groups)
    assert list(outputs[0].outputs[0].token_ids) == want
    assert counts.spec_decode.num_accepted_tokens > NEW_TOKENS // 4


def test_features_not_built_for_several_groups_are_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="holds no MTP layer .mtp.0.e_proj.weight is missing"):
        LLM(str(checkpoint), speculative_config=MTP)
    folder = shutil.copytree(checkpoint, tmp_path / "two-blocks")
    write_v4_mtp_block(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match="with 2 MTP blocks is not built"):
        LLM(str(folder), speculative_config=MTP)
    with pytest.raises(ValueError, match="several block-table groups moves what a prefix-cache hit reads"):
        LLM(str(checkpoint), role="prefill", kv_transfer="nixl", enable_prefix_caching=False)


def test_released_quantized_checkpoint_keeps_its_formats(released):
    """Routed experts held as their FP4 codes and e8m0 scales (handed to the ops backend packed),
    the linears that compute through the ops backend as FP8, the grouped output projection
    dequantized at load."""
    folder, _ = released
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert f.get_slice("layers.0.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert f.get_slice("layers.0.ffn.experts.0.w1.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.0.attn.wq_a.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
    model = load_model(folder)
    layer = model.layers[1]
    assert isinstance(layer.mlp.experts.parametrizations.w13[0], PackedWeight)
    assert stored_weight(layer.mlp.experts, "w2").mxfp4  # what the packed grouped GEMM takes
    assert isinstance(layer.attn.q_a_proj.parametrizations.weight[0], BlockFP8)
    assert layer.attn.o_a_proj.weight.dtype == torch.float32 and "parametrizations" not in layer.attn.o_a_proj._modules


@pytest.mark.parametrize("ep", [1, 4])
def test_released_quantized_greedy_tokens_match_dequantized_twin(released, ep):
    """Both prompts prefilled in one step (chunking is the tests above's subject)."""
    folder, want = released
    with LLM(str(folder), ep=ep, **dict(ENGINE, max_num_batched_tokens=256)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


NAN_E8M0 = 255  # the one e8m0 byte that is no power of two


@pytest.mark.parametrize(
    "tensor,bad",
    [
        ("layers.3.attn.wo_b.scale", torch.full((1, 1), 0.3)),  # a float32 scale of another value
        ("layers.3.attn.wo_b.scale", torch.full((1, 1), NAN_E8M0, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
        (
            "layers.1.ffn.experts.6.w2.scale",
            torch.full((64, 1), NAN_E8M0, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        ),
    ],
    ids=["fp8-float32", "fp8-e8m0", "fp4-expert"],
)
def test_scale_not_a_power_of_two_is_refused_by_name(released, tmp_path, tensor, bad):
    """`scale_fmt: ue8m0` promises powers of two, and e8m0 has no other value but its NaN byte."""
    folder = shutil.copytree(released[0], tmp_path / "bad")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[tensor] = bad
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=rf"tensor {re.escape(tensor)} holds (0\.3\d*|nan|the e8m0 NaN byte) at \[0, 0\]"
    ):
        load_model(folder)


def test_base_release_fp8_experts_run_the_fp8_expert_path(checkpoint, tmp_path):
    """The base models' release (`expert_dtype: fp8`, float32 power-of-two scales): experts held
    FP8 as DeepSeek-V3's are, each MoE block and FP8 projection computing what its dequantized
    twin's does."""
    folder = shutil.copytree(checkpoint, tmp_path / "base")
    quantize_checkpoint(folder, expert_dtype="fp8")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert f.get_slice("layers.0.ffn.experts.0.w1.scale").get_dtype() == "F32"
    model, twin = load_model(folder), load_model(write_dequantized_twin(folder, tmp_path / "dequantized"))
    x, ids = torch.randn(6, model.cfg.hidden_size), torch.tensor([5, 9, 11, 13, 300, 7])
    for layer, reference in zip(model.layers, twin.layers, strict=True):  # hash-routed and learned
        assert isinstance(layer.mlp.experts.parametrizations.w13[0], BlockFP8)
        torch.testing.assert_close(layer.mlp(x, None, ids), reference.mlp(x, None, ids), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.attn.q_a_proj(x), reference.attn.q_a_proj(x), rtol=1e-5, atol=1e-6)
        assert torch.equal(layer.attn.o_a_proj.weight, reference.attn.o_a_proj.weight)
