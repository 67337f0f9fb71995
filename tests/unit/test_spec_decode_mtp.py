"""Speculative decoding with the multi-token prediction layers `make-model` writes, through `LLM`:
greedy tokens with MTP drafts (one and three per step) are those without, for DeepSeek-V3 (MLA)
and GLM-4.5, and (two per step) for Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3.2 and GLM-5, in their
releases' layouts; drafts of an MTP layer built to agree with the target are kept; more drafts
than MTP layers reuse the last one; a mixed run with preemption and aborts leaks no KV block; and a
checkpoint without MTP weights is refused by the config key it lacks."""

from __future__ import annotations

import pytest
import torch
from helpers.mtp_checkpoints import mtp_checkpoint
from helpers.stats import CountingStatLogger
from safetensors import safe_open

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.models import load_model

ENGINE = dict(block_size=4, max_model_len=96)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (6, 19, 31)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp")


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_greedy_tokens_with_mtp_drafts_are_those_without_and_drafts_are_kept(root, arch):
    folder = str(mtp_checkpoint(root, arch))
    expected = token_ids(LLM(folder, **ENGINE).generate(prompts(), GREEDY, use_tqdm=False))
    for k in (1, 3):
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], speculative_config=mtp(k), **ENGINE)
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
        spec = counts.spec_decode
        assert len(spec.accepted_per_position) == k
        # The aligned MTP layer predicts the one-layer target well: most first drafts are kept.
        assert spec.accepted_per_position[0] > spec.num_drafts / 3
        assert llm.engine.scheduler.num_used_blocks == 0


@pytest.mark.parametrize(
    "arch, aligned",
    [
        *((arch, True) for arch in ("qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa")),
        # The DSA archs' random layers are DeepSeek's writer, drafted with below at two layers.
        ("qwen3_next", False),
        ("qwen3_5_moe", False),
    ],
)
def test_make_model_mtp_layer_of_the_newer_archs_drafts_the_greedy_tokens(root, arch, aligned):
    """The aligned layer over a one-layer target has most first drafts kept; the random one over the
    default two-layer target (the hybrids': a DeltaNet, then full attention) has its layer read from
    the helper's layout, where a misnamed tensor fails the load."""
    folder = str(mtp_checkpoint(root, arch, aligned=aligned))
    expected = token_ids(LLM(folder, **ENGINE).generate(prompts(), GREEDY, use_tqdm=False))
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], speculative_config=mtp(2), **ENGINE)
    assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
    spec = counts.spec_decode
    assert spec.num_draft_tokens > 0
    assert not aligned or spec.accepted_per_position[0] > spec.num_drafts / 3
    assert llm.engine.scheduler.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_more_drafts_than_layers_reuse_the_last_of_two_random_mtp_layers(root, arch):
    """A two-layer target with two random MTP layers: three drafts run layer 0, 1 and 1 again (on
    DeepSeek-V3.2, each MTP layer with an indexer of its own)."""
    folder = str(mtp_checkpoint(root, arch, mtp_layers=2, aligned=False))
    expected = token_ids(LLM(folder, **ENGINE).generate(prompts(), GREEDY, use_tqdm=False))
    counts = CountingStatLogger()
    llm = LLM(folder, stat_loggers=[counts], speculative_config=mtp(3), **ENGINE)
    assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False)) == expected
    assert counts.spec_decode.num_draft_tokens > 0
    assert llm.engine.scheduler.num_used_blocks == 0


def test_mtp_weights_load_as_stored_and_the_target_is_the_checkpoint_without_them(root):
    folder = mtp_checkpoint(root, "glm4_moe")
    plain = make_model(MakeModelSpec("glm4_moe", layers=1, first_k_dense_replace=0), root / "glm4_moe-plain")
    assert (folder / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    model = load_model(folder, with_mtp=True)
    layer = model.cfg.num_layers
    with safe_open(str(folder / "model-mtp.safetensors"), "pt") as f:
        assert torch.equal(model.mtp[0].eh_proj, f.get_tensor(f"model.layers.{layer}.eh_proj.weight"))
        assert torch.equal(model.mtp[0].head, f.get_tensor(f"model.layers.{layer}.shared_head.head.weight"))
        down = f.get_tensor(f"model.layers.{layer}.mlp.experts.3.down_proj.weight")
    assert torch.equal(model.mtp[0].moe.experts.w2[3], down)
    assert not load_model(folder).mtp  # loaded only to draft


def test_a_mixed_run_with_aborts_and_preemption_keeps_tokens_and_leaks_no_block(root):
    folder = str(mtp_checkpoint(root, "deepseek_v3"))
    tight = dict(ENGINE, kv_cache_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    batch = prompts() + prompts()[:2] + [{"prompt_token_ids": prompts()[1]["prompt_token_ids"][:12]}]
    params = [GREEDY, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    params += [SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True), GREEDY, GREEDY, GREEDY]

    def run(**options) -> tuple[dict[str, tuple], LLM, CountingStatLogger]:
        counts = CountingStatLogger()
        llm = LLM(folder, stat_loggers=[counts], **tight, **options)
        engine = llm.engine
        ids = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(batch, params))]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps in (5, 8):
                engine.abort_request(ids[3 if steps == 5 else 4])
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        return done, llm, counts

    expected, _, _ = run()
    got, llm, counts = run(speculative_config=mtp(3))
    assert {k: v for k, v in got.items() if k != "2"} == {k: v for k, v in expected.items() if k != "2"}
    assert counts.num_preemptions > 0 and counts.spec_decode.num_accepted_tokens > 0
    assert "3" not in got and "4" not in got and got["1"][1] == "length"
    assert llm.engine.scheduler.num_used_blocks == 0


def test_a_checkpoint_without_mtp_weights_is_refused_by_the_key_it_lacks(root, make_checkpoint):
    """transformers' own save says num_nextn_predict_layers 1 and writes no MTP layer; the builder
    without mtp_layers says 0."""
    for folder, said in ((make_checkpoint("deepseek_v3", 3), "is 1, but"), (root / "glm4_moe-plain", "is 0 or absent")):
        with pytest.raises(ValueError, match=f"num_nextn_predict_layers {said}"):
            LLM(str(folder), speculative_config=mtp(1), **ENGINE)
