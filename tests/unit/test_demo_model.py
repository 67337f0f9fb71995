"""The trained demo model that ships with the package: small, the demo's shape, and trained (it
predicts the standard library's text far better than chance, and ends its chat turns itself)."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from moeserve import LLM, SamplingParams
from moeserve.checkpoints import demo_model_path
from moeserve.checkpoints.train_demo import TRAINED_DEMO_SPEC, TrainDemoConfig

MAX_BYTES = 4 * 1024 * 1024


def test_it_ships_small_in_the_demo_shape() -> None:
    path = demo_model_path()
    assert sum(f.stat().st_size for f in path.iterdir()) < MAX_BYTES
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.dtype) == ("qwen3_moe", torch.bfloat16)
    shape = (config.num_hidden_layers, config.hidden_size, config.num_experts, config.vocab_size)
    spec = TRAINED_DEMO_SPEC
    assert shape == (spec.layers, spec.hidden, spec.experts, spec.vocab)
    assert len(AutoTokenizer.from_pretrained(path)) == config.vocab_size


def test_it_predicts_the_standard_library() -> None:
    """Mean next-token loss on a stdlib module well under a uniform guess's ln(vocab)."""
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = torch.tensor([tokenizer.encode(text)[: TrainDemoConfig().context]])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.5 * math.log(TRAINED_DEMO_SPEC.vocab), loss


def test_it_answers_a_chat_in_words_and_stops() -> None:
    llm = LLM(None)
    question = [{"role": "user", "content": "What does os.path.join do?"}]
    output = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop", output
    words = output.text.split()
    assert len(words) >= 3 and all(word.strip(".,:;()'\"`").isascii() for word in words), output.text
