"""The `moeserve` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer


def run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "mixtral"
    result = run_cli("make-model", "--arch", "mixtral", "--out", str(out), "--layers", "2", "--hidden", "64", "--experts", "6", "--top-k", "2", "--vocab", "300", "--seed", "3")
    assert result.returncode == 0, result.stderr
    return out


def test_make_model_writes_a_checkpoint_transformers_loads(made):
    model = AutoModelForCausalLM.from_pretrained(made)
    assert model.config.num_local_experts == 6 and model.config.vocab_size == 300
    assert AutoTokenizer.from_pretrained(made).chat_template
    assert (made / "generation_config.json").exists()


def test_generate_json(made):
    result = run_cli("generate", "--model", str(made), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert len(payload["token_ids"]) == 6 and isinstance(payload["text"], str)
    again = json.loads(run_cli("generate", "--model", str(made), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--json").stdout)
    assert again == payload  # greedy is deterministic


def test_generate_on_the_demo_model(tmp_path):
    import os

    env = {**os.environ, "MOESERVE_CACHE_DIR": str(tmp_path)}
    result = run_cli("generate", "--prompt", "Hello", "--max-tokens", "4", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) <= 4
    assert any(p.name.startswith("demo-") for p in tmp_path.iterdir())


def test_bad_input_is_one_clear_line(made):
    result = run_cli("generate", "--model", str(made), "--prompt-ids", "5,99999", "--json")
    assert result.returncode == 2
    assert "out of the vocabulary" in result.stderr
    assert "Traceback" not in result.stderr
