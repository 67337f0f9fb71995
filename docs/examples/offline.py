import os

from moeserve import LLM, SamplingParams

# A Hugging Face checkpoint folder; None (MOESERVE_MODEL unset): the built-in demo model.
with LLM(os.environ.get("MOESERVE_MODEL"), max_model_len=256) as llm:
    outs = llm.generate(
        ["The capital of France is", {"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(max_tokens=16, temperature=0.0),
    )
    for out in outs:
        print(repr(out.outputs[0].text), out.outputs[0].finish_reason)
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16, seed=7, temperature=0.7))
    print(chat[0].outputs[0].text)
