"""The offline engine end to end: batch invariance, paged KV reuse, sampling and bad input."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_folder(make_checkpoint):
    return make_checkpoint("qwen3_moe", 7, num_experts=6, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def deepseek_folder(make_checkpoint):
    return make_checkpoint("deepseek_v3", 3)


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("folder_fixture", ["qwen3_folder", "deepseek_folder"])
def test_batch_invariance(request, folder_fixture):
    llm = LLM(str(request.getfixturevalue(folder_fixture)), block_size=8, max_model_len=128)
    prompts = random_prompts(8, seed=1)
    batched = token_ids(llm.generate(prompts, GREEDY))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert batched == alone


def test_paged_kv_no_cross_talk_when_blocks_are_reused(qwen3_folder):
    """Prompts spanning many 4-token blocks; a cache so small that sequences must take over
    blocks freed by others (and get preempted): outputs still equal a roomy engine's."""
    prompts = random_prompts(6, seed=2, lo=20, hi=40)
    roomy = LLM(str(qwen3_folder), block_size=4, max_model_len=64, kv_cache_blocks=512)
    expected = token_ids(roomy.generate(prompts, GREEDY))
    tight = LLM(str(qwen3_folder), block_size=4, max_model_len=64, kv_cache_blocks=24)
    assert token_ids(tight.generate(prompts, GREEDY)) == expected
    scheduler = tight.engine.scheduler
    assert scheduler.num_used_blocks == 0
    # Run again on the now fully recycled pool, in the reverse order.
    assert token_ids(tight.generate(prompts[::-1], GREEDY)) == expected[::-1]


def test_chunked_prefill_gives_the_same_tokens(qwen3_folder):
    prompts = random_prompts(4, seed=3, lo=30, hi=40)
    whole = token_ids(LLM(str(qwen3_folder), max_model_len=128).generate(prompts, GREEDY))
    chunked = LLM(str(qwen3_folder), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8)
    assert token_ids(chunked.generate(prompts, GREEDY)) == whole


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    prompts = random_prompts(4, seed=4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    first = token_ids(llm.generate(prompts, seeded))
    assert token_ids(llm.generate(prompts, seeded)) == first
    # The same seeded request alone gives the same tokens as in the batch.
    assert token_ids(llm.generate([prompts[2]], seeded))[0] == first[2]
    other_seed = token_ids(
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))
    )
    assert other_seed != first
    top1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True)
    assert token_ids(llm.generate(prompts, top1)) == token_ids(
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    )


def test_n_returns_distinct_seeded_samples(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    out = llm.generate([random_prompts(1, seed=5)[0]], SamplingParams(n=3, max_tokens=12, seed=1, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_string_cuts_text_and_sets_finish_reason(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    prompt = random_prompts(1, seed=6)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]
    assert stop not in cut.text
    kept = llm.generate(
        [prompt],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_and_eos(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    prompt = random_prompts(1, seed=8)[0]
    full = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_id = full[5]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full[: full.index(stop_id) + 1]


def test_logprobs_are_returned(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    out = llm.generate(
        [random_prompts(1, seed=9)[0]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].logprob <= 0
        assert len(entry) >= 3
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_text_prompt_and_chat(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=256)
    out = llm.generate("def main():", SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt == "def main():"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("def main():")
    messages = [{"role": "user", "content": "hi"}]
    chat = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    tokenizer = llm.get_tokenizer()
    rendered = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert chat.prompt_token_ids == rendered
    assert len(chat.outputs[0].token_ids) == 3 and chat.outputs[0].finish_reason == "length"
    # The chat is the templated prompt, generated like any other.
    plain = llm.generate({"prompt_token_ids": rendered}, GREEDY)[0].outputs[0]
    assert chat.outputs[0].token_ids == plain.token_ids[:3]


def test_a_stop_string_frees_the_requests_blocks_in_the_step_that_matched_it(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    prompt = random_prompts(1, seed=6)[0]
    text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[text[3:5]]))
    while True:
        (output,) = engine.step()
        if output.finished:
            break
        assert engine.scheduler.num_used_blocks > 0
    assert output.outputs[0].finish_reason == "stop" and len(output.outputs[0].token_ids) < 24
    assert engine.scheduler.num_used_blocks == 0 and not engine.scheduler.has_unfinished_requests()


def test_finished_requests_reach_the_runner_which_drops_their_state(qwen3_folder):
    """Sampling state (tokens, seeded generators) lives on the runner from a request's first plan
    to the plan after it finished, whichever way it finished."""
    llm = LLM(str(qwen3_folder), max_model_len=128)
    engine, runner = llm.engine, llm.engine.executor.runner
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    llm.generate(random_prompts(3, seed=10), seeded, use_tqdm=False)
    first = set(runner.request_ids)
    assert first  # the last step's finishes are told with the next plan
    engine.add_request(random_prompts(1, seed=11)[0], SamplingParams(max_tokens=8), request_id="doomed")
    engine.step()
    assert not first & set(runner.request_ids) and "doomed" in runner.request_ids
    engine.abort_request("doomed")
    llm.generate(random_prompts(1, seed=12), seeded, use_tqdm=False)
    assert "doomed" not in runner.request_ids


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "out of the vocabulary"),
        ({"prompt_token_ids": [1, -1]}, SamplingParams(), "out of the vocabulary"),
        ({"prompt_token_ids": list(range(3, 3 + 128))}, SamplingParams(), "maximum context length"),
    ],
)
def test_bad_input_raises_value_error(qwen3_folder, prompt, params, message):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    # Nothing was queued and nothing leaked: the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.num_used_blocks == 0
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_bad_sampling_params_raise_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_a_bad_prompt_in_a_batch_queues_nothing(qwen3_folder):
    llm = LLM(str(qwen3_folder), max_model_len=128)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_auto_dtype_is_the_checkpoints(tmp_path, monkeypatch):
    from moeserve.checkpoints import MakeModelSpec, make_model

    # On a CPU with bf16 instructions, as on CUDA; without them auto means float32 (test_cpu_dtype).
    monkeypatch.setattr("moeserve.cpu_features.cpu_has_native_bf16", lambda: True)

    folder = make_model(MakeModelSpec(arch="mixtral", vocab=320, dtype="bfloat16"), tmp_path / "bf16")
    assert LLM(str(folder), max_model_len=64).engine.executor.model.embed_tokens.dtype == torch.bfloat16
    assert LLM(str(folder), dtype="float32", max_model_len=64).engine.executor.model.embed_tokens.dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        LLM(str(folder), dtype="float8")


def test_a_refused_sample_takes_back_its_siblings(qwen3_folder, monkeypatch):
    """If the scheduler refuses the 2nd of n samples (say its queue is full), the 1st is not
    left queued without an owner."""
    llm = LLM(str(qwen3_folder), max_model_len=128)
    scheduler = llm.engine.scheduler
    original, calls = scheduler.add_request, []

    def refuse_second(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise ValueError("queue full")
        original(request)

    monkeypatch.setattr(scheduler, "add_request", refuse_second)
    with pytest.raises(ValueError, match="queue full"):
        llm.engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    assert not scheduler.has_unfinished_requests()
    assert not llm.engine.has_unfinished_requests()


def test_min_step_time_pads_every_step(qwen3_folder):
    """The test-only capacity knob: n decode steps take at least n * floor."""
    import time

    llm = LLM(str(qwen3_folder), min_step_time_ms=40.0)
    started = time.monotonic()
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    elapsed = time.monotonic() - started
    assert len(out[0].outputs[0].token_ids) == 5
    assert elapsed >= 5 * 0.040
