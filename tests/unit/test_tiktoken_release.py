"""A tokenizer released as Kimi's (tiktoken ranks behind `tokenization_kimi.py`) is served as a
fast tokenizer that encodes and decodes exactly as tiktoken does with the release's pattern and
special tokens, without the release's code ever running (its class file raises when imported)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers.tiktoken_release import (
    CORPUS,
    NAMED,
    RESERVED,
    reference_encoding,
    special_tokens,
    train_ranks,
    write_release,
)

from moeserve.engine.tiktoken_release import is_tiktoken_release
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.models import CheckpointError

# Characters of every class the pattern treats apart: Han, upper/lower/other letters, marks,
# digits, punctuation, apostrophes (contractions), spaces, tabs and line breaks, emoji.
ALPHABET = "专家模型混合路由 aeiostEXTHÉçßÅñ\u0301\u05d0\u0627 0123456789 '' sSTdD .,;!?<>{}[]|  \t\n\r\n 🤖"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder, our tokenizer, tiktoken's reference encoding)."""
    ranks = train_ranks()
    folder = write_release(tmp_path_factory.mktemp("kimi-tokenizer"), ranks)
    return folder, load_tokenizer(folder), reference_encoding(ranks)


def texts() -> list[str]:
    rng = random.Random(45)
    fuzz = ["".join(rng.choices(ALPHABET, k=rng.randint(1, 60))) for _ in range(300)]
    specials = f"{NAMED[3]}user{NAMED[7]}hi THERE{NAMED[2]}<|reserved_token_{300}|>[BOS]x"
    return [CORPUS, CORPUS.upper(), specials, "  \n\n x  ", "I'M, they'RE Ångström\r\n\r\n\t\t  x", *fuzz]


def test_encodes_and_decodes_as_tiktoken(release):
    folder, tokenizer, reference = release
    assert is_tiktoken_release(folder) and not (folder / "tokenizer.json").exists()
    mismatched = [
        t
        for t in texts()
        if tokenizer.encode(t, add_special_tokens=False) != reference.encode(t, allowed_special="all")
    ]
    assert not mismatched, f"{len(mismatched)} texts encode differently, e.g. {mismatched[0]!r}"
    # Every id once, in an order that cuts multi-byte characters: invalid UTF-8 decodes alike too.
    ids = list(range(reference.n_vocab))
    random.Random(7).shuffle(ids)
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.decode([i for i in ids if i < len(tokenizer) - RESERVED], skip_special_tokens=True) == (
        reference.decode([i for i in ids if i < reference.n_vocab - RESERVED])
    )


def test_special_tokens_and_chat_template_are_the_releases(release):
    folder, tokenizer, reference = release
    base = reference.n_vocab - RESERVED
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in special_tokens(base)} == special_tokens(base)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (base, base + 1, base + 2)
    assert len(tokenizer) == reference.n_vocab == base + RESERVED
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_malformed_releases_are_refused_by_file_and_field(release, tmp_path):
    folder = release[0]

    def broken(name: str, edit) -> Path:
        copy = shutil.copytree(folder, tmp_path / name.replace(".", "_"))
        path = copy / name
        path.write_text(edit(path.read_text()))
        return copy

    no_pattern = broken("tokenization_kimi.py", lambda s: s.replace("pat_str =", "pattern ="))
    with pytest.raises(
        CheckpointError, match=r"tokenization_kimi\.py: class TikTokenTokenizer defines no string pat_str"
    ):
        load_tokenizer(no_pattern)
    bad_rank = broken("tiktoken.model", lambda s: s.replace(" 3\n", " x\n", 1))
    with pytest.raises(CheckpointError, match=r"tiktoken\.model line 4 is not `<base64 token> <rank>`"):
        load_tokenizer(bad_rank)

    def outside(text: str) -> str:
        config = json.loads(text)
        config["added_tokens_decoder"]["9999"] = {"content": "<|far|>", "special": True}
        return json.dumps(config)

    with pytest.raises(CheckpointError, match=r"added_tokens_decoder names id 9999, outside the special ids"):
        load_tokenizer(broken("tokenizer_config.json", outside))
