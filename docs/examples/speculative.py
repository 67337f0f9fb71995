import os

from moeserve import LLM, SamplingParams

spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
with LLM(os.environ.get("MOESERVE_MODEL"), max_model_len=256, speculative_config=spec) as llm:
    prompt = "one two three four one two three four one two"
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    print(repr(out.text))
