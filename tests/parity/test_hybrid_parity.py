"""Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet + gated attention) against transformers.

Checkpoints are written by transformers (random weights; zero-centred norms and dt_bias
randomised so their paths count): Qwen3.5's three DeltaNets then one full attention, Qwen3-Next
alternating, and Qwen3.5's multimodal checkpoint whose text model sits under the language model's
prefix. Prompts of 40 to 200 tokens, 32 greedy tokens, whole and in chunks of 16 tokens (each
chunk resumes from the state the previous one left).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.reference import hf_greedy_tokens, hf_model, prefill_logits
from helpers.stacked_experts import stack_experts
from helpers.stats import CountingStatLogger

from moeserve import LLM, SamplingParams
from moeserve.checkpoints.mtp import write_qwen_mtp_layer
from moeserve.config import EngineConfig
from moeserve.engine.core import state_refusal
from moeserve.models import load_model
from moeserve.models.decoder import cache_specs
from moeserve.worker.state_slots import StateSlots

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (40, 97, 200)


def prompts_for(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(2000 + seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "qwen3_5_moe_vl"])
def test_prefill_logits_match(make_checkpoint, arch):
    folder = make_checkpoint(arch)
    prompts = prompts_for(0, (1, 5, 40, 70))
    ref = hf_model(folder)
    with torch.inference_mode():
        expected = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])
    got = prefill_logits(load_model(folder), prompts)
    assert (got - expected).abs().max().item() < 1e-4


def test_cache_specs_declare_states_for_deltanets_only(make_checkpoint):
    """Qwen3.5's layers 0-2 keep a state (conv + float32 recurrent), layer 3 paged K/V; a block
    costs the one attention layer's K and V, a sequence's states do not depend on its length."""
    cfg = load_model(make_checkpoint("qwen3_5_moe")).cfg
    specs = cache_specs(cfg, torch.bfloat16)
    kinds = [type(s).__name__ for s in specs.layers]
    assert kinds == ["StateSpec"] * 3 + ["PagedSpec"]
    assert specs.bytes_per_block(16) == 16 * 2 * 2 * 16 * 2  # tokens x (K, V) x 2 heads x 16 dims x bf16
    conv = (2 * 2 * 8 + 4 * 12) * 3 * 2  # channels x (kernel - 1) x bf16
    recurrent = 4 * 8 * 12 * 4  # value heads x Dk x Dv x float32
    assert specs.state_bytes_per_sequence == 3 * (conv + recurrent)
    assert specs.bytes_per_sequence(1000, 16) - specs.bytes_per_sequence(16, 16) == 62 * specs.bytes_per_block(16)


@pytest.mark.parametrize(
    "arch,kernels,lengths,num_tokens",
    [
        ("qwen3_5_moe", "torch", PROMPT_LENGTHS, 32),
        ("qwen3_next", "torch", PROMPT_LENGTHS, 32),
        ("qwen3_next", "triton", (25,), 2),
    ],
    ids=["qwen3_5_moe", "qwen3_next", "qwen3_next-triton"],
)
def test_greedy_generation_in_chunks_of_16_matches(make_checkpoint, monkeypatch, arch, kernels, lengths, num_tokens):
    """Prompts of 40 to 200 tokens prefilled 16 tokens a step, each chunk resuming the state the
    last left. A prompt in one step is compared with transformers by the prefill-logits test and
    by the EP layouts' runs (whose 64-token chunks hold the 40-token prompt whole). On the Triton
    kernels (under the interpreter, so one short prompt and two tokens) both chunks, of 16 and 9
    tokens, take the chunked delta-rule kernel, the second from the state the first left, and the
    decode the recurrent one."""
    from moeserve.ops import triton_ops

    chunked = []  # per launch of the chunked kernel, the lengths of the sequences it ran
    launch = triton_ops.chunk_gated_delta_rule_varlen

    def counted(*args, chosen, **kwargs):
        chunked.append([args[6][i] for i in chosen])  # args[6]: the step's query lengths
        return launch(*args, chosen=chosen, **kwargs)

    monkeypatch.setattr(triton_ops, "chunk_gated_delta_rule_varlen", counted)
    folder = make_checkpoint(arch)
    ref = hf_model(folder)
    prompts = prompts_for(1, lengths)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "kernels": kernels}
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    outputs = LLM(str(folder), dtype="float32", **options).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy_tokens(ref, prompt, num_tokens)
    if kernels == "triton":  # two DeltaNet layers, each launching it once per chunk
        assert chunked == [[16], [16], [9], [9]]


def test_stacked_experts_as_released(make_checkpoint, tmp_path):
    folder = make_checkpoint("qwen3_5_moe")
    prompts = prompts_for(2, (9, 40))
    per_expert = prefill_logits(load_model(folder), prompts)
    released = load_model(stack_experts(folder, tmp_path / "stacked"))
    assert torch.equal(prefill_logits(released, prompts), per_expert)


def test_no_state_slot_or_block_leaks_after_preemption_aborts_and_prefix_hits(make_checkpoint):
    """A cache so small that sequences are preempted (their slots freed, their prompts recomputed
    from zeros or a saved state into another slot), one request aborted mid-prompt, prompts that
    extend others (prefix-cache hits resuming from saved states): the tokens equal those of a
    roomy engine without prefix caching, and afterwards every block and every slot but the last
    request's is free, and no saved state is left half-written."""
    folder = str(make_checkpoint("qwen3_next"))
    base = prompts_for(3, (40, 52, 61, 45))
    extended = [base[0] + base[3][:12], base[1] + base[2][:9]]  # each admitted once its prefix is saved
    prompts = [{"prompt_token_ids": p} for p in (base[0], extended[0], base[1], extended[1], *base[2:])]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = LLM(folder, max_num_seqs=4, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    counts = CountingStatLogger()
    tight = LLM(
        folder,
        block_size=4,
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_blocks=40,
        saved_states=2,
        stat_loggers=[counts],
    )
    engine, runner = tight.engine, tight.engine.executor.runner
    engine.add_request(prompts[0], params, request_id="doomed")
    engine.step()
    engine.abort_request("doomed")
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert counts.num_preemptions > 0 and counts.prefix_cache_hits > 0
    tight.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.scheduler.num_used_blocks == 0
    assert len(runner.states.request_ids) <= 1 and runner.states.num_free >= runner.states.num_slots - 1
    saved = engine.scheduler.groups[0].block_manager.saved_states
    assert saved.num_pending == 0 and 0 < saved.num_held <= 2


@pytest.mark.parametrize(
    "arch,kernels,lengths,num_tokens",
    [
        ("qwen3_next", "torch", (20, 45), 32),
        ("qwen3_5_moe", "torch", (20, 45), 32),
        ("qwen3_next", "triton", (3, 5), 8),
    ],
    ids=["qwen3_next", "qwen3_5_moe", "qwen3_next-triton"],
)
def test_ngram_drafts_give_the_greedy_tokens(make_checkpoint, monkeypatch, arch, kernels, lengths, num_tokens):
    """n-gram drafts verified through the DeltaNets: each verify step keeps the state after every
    token, and the next step continues from the last accepted one. Prompts that repeat themselves,
    so drafts are made, some accepted, most rejected: the tokens equal plain greedy decoding's,
    and steps did step back (without the restore they do not: the tokens change). On the Triton
    kernels (under the interpreter: short prompts, few tokens) the verify spans' states are the
    kernels' and plain decoding is the torch path's, in float32."""
    folder = str(make_checkpoint(arch))
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 320, (lengths[0],), generator=g).tolist()
    prompts = [{"prompt_token_ids": p} for p in (base * 3, torch.randint(3, 320, (lengths[1],), generator=g).tolist())]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    options = {"max_num_seqs": 4, "dtype": "float32" if kernels == "triton" else "auto"}
    plain = [o.outputs[0].token_ids for o in LLM(folder, **options).generate(prompts, params, use_tqdm=False)]
    restores, restore = [], StateSlots._restore

    def spy(self, scheduled):
        restores.append(restore(self, scheduled))
        return restores[-1]

    monkeypatch.setattr(StateSlots, "_restore", spy)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    drafting = LLM(folder, kernels=kernels, speculative_config=ngram, **options)
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params, use_tqdm=False)] == plain
    assert any(r >= 0 for r in restores)


def with_mtp_layer(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of `checkpoint` with an aligned MTP layer in the released layout."""
    folder = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, folder)
    write_qwen_mtp_layer(folder)
    return folder


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_drafts_give_the_greedy_tokens(make_checkpoint, monkeypatch, tmp_path, arch):
    """The released MTP layout (`mtp.fc`, `mtp.layers.0.`, ...; an aligned layer over the target's
    last full attention) drafting two tokens a step: the tokens equal plain greedy decoding's
    (whose parity with transformers the tests above hold), the DeltaNet states stepped back past
    rejected drafts, the MTP layer's cache is an attention layer's in the paged group, and neither
    a KV block nor a state slot is left held."""
    folder = with_mtp_layer(make_checkpoint(arch), tmp_path)
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 320, (n,), generator=g).tolist()} for n in (40, 61)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(folder), max_num_seqs=4).generate(prompts, params, use_tqdm=False)]
    restores, restore = [], StateSlots._restore

    def spy(self, scheduled):
        restores.append(restore(self, scheduled))
        return restores[-1]

    monkeypatch.setattr(StateSlots, "_restore", spy)
    counts = CountingStatLogger()
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    drafting = LLM(str(folder), max_num_seqs=4, stat_loggers=[counts], speculative_config=mtp)
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params, use_tqdm=False)] == plain
    assert counts.spec_decode.num_draft_tokens > 0 and any(r >= 0 for r in restores)
    runner = drafting.engine.executor.runner
    specs = cache_specs(runner.model.cfg, torch.float32, 1, len(runner.model.mtp))
    assert len(runner.model.mtp) == 1 and len(specs.groups) == 1
    assert specs.layers[-1] == specs.layers[runner.model.cfg.linear_layers.index(False)]
    assert drafting.engine.scheduler.num_used_blocks == 0
    assert len(runner.states.request_ids) <= 1 and runner.states.num_free >= runner.states.num_slots - 1


def test_aligned_mtp_drafts_are_kept(make_checkpoint, tmp_path):
    """A one-layer full-attention target, whose aligned MTP layer predicts it but for attention to
    the first token (`checkpoints/mtp.py`): most drafts are kept, which they are only if the
    released names load where they belong (fc's embedding half first, zero-centred norms, the
    target's embedding and head); the tokens are still the plain greedy ones."""
    folder = str(
        with_mtp_layer(make_checkpoint("qwen3_next", num_hidden_layers=1, layer_types=["full_attention"]), tmp_path)
    )
    prompts = [{"prompt_token_ids": p} for p in prompts_for(5, (40,))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(folder).generate(prompts, params, use_tqdm=False)]
    counts = CountingStatLogger()
    drafting = LLM(folder, stat_loggers=[counts], speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in drafting.generate(prompts, params, use_tqdm=False)] == plain
    assert counts.spec_decode.accepted_per_position[0] > counts.spec_decode.num_drafts / 2


def test_features_not_built_for_states_are_refused(make_checkpoint):
    """Disaggregation without saved states is refused; drafts are served on either backend."""
    folder = str(make_checkpoint("qwen3_next"))
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    for kernels in ("torch", "triton"):
        assert state_refusal(EngineConfig.from_options(model=folder, kernels=kernels, speculative_config=ngram)) is None
    decode = EngineConfig.from_options(model=folder, role="decode", kv_transfer="nixl", saved_states=0)
    assert "enable prefix caching, with saved states > 0" in state_refusal(decode)
    assert state_refusal(EngineConfig.from_options(model=folder, role="decode", kv_transfer="nixl")) is None
    assert state_refusal(EngineConfig.from_options(model=folder)) is None


def test_the_start_up_step_profile_frees_the_state_slots_it_took(make_checkpoint):
    """The slo policy profiles steps at start-up with requests of its own, each in a state slot:
    the profile's last plan frees them all, so served requests find every slot and decode as
    without the profile."""
    folder = str(make_checkpoint("qwen3_5_moe"))
    prompts = [{"prompt_token_ids": p} for p in prompts_for(3)]
    plain = [o.outputs[0].token_ids for o in LLM(folder, max_num_seqs=4).generate(prompts, GREEDY, use_tqdm=False)]
    profiled = LLM(folder, max_num_seqs=4, scheduling_policy="slo")
    assert all(model.ready for model in profiled.engine.scheduler.step_time_models)
    assert profiled.engine.executor.runner.states.request_ids == []
    outputs = profiled.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain


def test_a_shared_prefix_resumes_from_a_saved_state(make_checkpoint):
    """A prompt, then the same prompt again, then a later turn (the prompt, its output, more): the
    first saves its states at its prompt's last block boundary before its last token, the later
    two resume from them (96 of their tokens are prefix-cache hits each), and every greedy token
    equals transformers' (the first run's, for the repeat). The gauges show two saved states
    (the second prompt's mark, 96, was saved already) and every state slot free."""
    folder = make_checkpoint("qwen3_5_moe")
    ref = hf_model(folder)
    first, more = prompts_for(4, (97, 20))
    counts = CountingStatLogger()
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=40, stat_loggers=[counts])

    def generate(prompt: list[int]) -> list[int]:
        return list(llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)

    tokens = generate(first)
    assert tokens == hf_greedy_tokens(ref, first, 32) and counts.prefix_cache_hits == 0
    assert generate(first) == tokens and counts.prefix_cache_hits == 96
    turn = first + tokens + more
    assert generate(turn) == hf_greedy_tokens(ref, turn, 32) and counts.prefix_cache_hits == 2 * 96
    gauges = llm.engine.core.scheduler_stats()
    assert (gauges.state_slots_used, gauges.state_slots_total) == (0, 4)
    assert (gauges.saved_states_held, gauges.saved_states_total) == (2, 4)
