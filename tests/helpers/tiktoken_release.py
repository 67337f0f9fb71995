"""A tiny tokenizer released as Kimi's is: `tiktoken.model`, a `tokenization_kimi.py` named by
`auto_map`, special tokens in tokenizer_config.json and a `chat_template.jinja`; and the
reference it must encode like, tiktoken itself, built from the same ranks, pattern and specials.

The ranks are learnt here (byte-pair merges over a small mixed-script corpus) so that merges of
every kind occur: ASCII words, multi-byte UTF-8 characters, Han runs, digits and whitespace.
The class file raises when imported: a loader that ran it would fail.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

# tokenization_kimi.py's pat_str, as Moonshot's release spells it (a list joined by "|").
PATTERN_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
PATTERN = "|".join(PATTERN_PARTS)
RESERVED = 16
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|im_system|>"}
NAMED[7] = "<|im_middle|>"
CORPUS = (
    "the experts of the mixture answer the tokens they are routed to; it's the router's choice. "
    "The Experts THE EXPERTS they're we've I'm you'll he'd 12345 678 90 2026-11-28 "
    "专家混合模型 专家 模型的路由 混合专家模型 café naïve déjà vu Ñandú über straße "
    "  indented\n\n\tline\r\nend  of   text!!! ... ??? <tag> {json: [1, 2]} "
)
MERGES = 40

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_ranks(corpus: str = CORPUS, merges: int = MERGES) -> dict[bytes, int]:
    """The 256 bytes, then `merges` tokens, each the most frequent adjacent pair of the corpus's
    space-led words (ties to the pair seen first)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in (" " + w).encode()] for w in corpus.split(" ") if w]
    for _ in range(merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        (left, right), _count = pairs.most_common(1)[0]
        ranks[left + right] = len(ranks)
        words = [_merge(w, left, right) for w in words]
    return ranks


def _merge(word: list[bytes], left: bytes, right: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def special_tokens(base: int) -> dict[str, int]:
    """The reference's specials: the reserved ids after the ranks, named or `<|reserved_token_i|>`."""
    return {NAMED.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(RESERVED)}


def write_release(folder: Path, ranks: dict[bytes, int]) -> Path:
    """`folder` with the tokenizer files of a Kimi release (no tokenizer.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items())
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    joined = ",\n".join(f'        r"""{part}"""' for part in PATTERN_PARTS)
    (folder / "tokenization_kimi.py").write_text(
        'raise RuntimeError("tokenization_kimi.py was executed")\n\n\n'
        "class TikTokenTokenizer:\n"
        '    vocab_files_names = {"vocab_file": "tiktoken.model"}\n'
        f"    num_reserved_special_tokens = {RESERVED}\n"
        f'    pat_str = "|".join(\n        [\n{joined}\n        ]\n    )\n'
        "    special_tokens: dict\n"
    )
    base = len(ranks)
    added = {str(base + i): {"content": c, "special": True} for i, c in NAMED.items()}
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": NAMED[2],
        "model_max_length": 262144,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def reference_encoding(ranks: dict[bytes, int]):
    """tiktoken's `Encoding` as the release's class builds it."""
    import tiktoken

    return tiktoken.Encoding(
        "kimi-tiny", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=special_tokens(len(ranks))
    )
