"""A byte-level BPE tokenizer trained locally, in the layout Hugging Face checkpoints use.

Why local: tests and the demo model need a real tokenizer (``tokenizer.json`` +
``tokenizer_config.json`` with a chat template) without any download. The training text is the
source of the Python standard library, which every Python install ships, read in sorted order and
cut to a fixed size, so the result is the same on every run for a given Python version (about a
third of a second). Byte-level means every UTF-8 string round-trips, whatever the corpus missed.
"""

import json
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"

# The trainer gives special tokens the first ids, in this order: pad=0, bos=1, eos=2 (Mixtral's
# bos/eos ids), then the ChatML markers.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
"""The markers of OpenAI's harmony format (gpt-oss), special tokens of a ``chat_format="harmony"``
tokenizer, with the ids after `SPECIAL_TOKENS`'."""
HARMONY_IDS = dict(zip(HARMONY_TOKENS, range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(HARMONY_TOKENS))))

NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS)
"""The smallest vocabulary that holds every byte and every special token (no merges)."""

_CORPUS_CHARS = 1_000_000  # fixed size: ~0.3 s of training, room for ~13k tokens
_CHARS_PER_FILE = 8_192  # a slice of many modules rather than all of a few, for variety
_RESERVED_TOKEN = "<|reserved_{}|>"

# ChatML (as Qwen uses it). Content may be a string, a list of OpenAI-style text parts, or None
# (an assistant turn that only calls tools). With `tools`, the Hermes convention the `hermes`
# tool-call parser reads: the tools' JSON signatures in the system turn, each call written as
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and tool results sent back as
# `<tool_response>` blocks in one user turn per run of tool messages.
CHAT_TEMPLATE = r"""
{%- macro text(message) -%}
{%- if message['content'] is none -%}
{%- elif message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{{- message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -}}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages and messages[0]['role'] == 'system' -%}
{{- text(messages[0]) + '\n\n' -}}
{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' + (tool | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
{{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}
{{- raise_exception('unsupported role: ' + role) -}}
{%- endif -%}
{%- if role == 'system' and not loop.first -%}
{{- raise_exception('the system message must come first') -}}
{%- endif -%}
{%- set after_tool = not loop.first and messages[loop.index0 - 1]['role'] == 'tool' -%}
{%- set before_tool = not loop.last and messages[loop.index0 + 1]['role'] == 'tool' -%}
{%- if role == 'tool' -%}
{{- ('' if after_tool else '<|im_start|>user') + '\n<tool_response>\n' + text(message) + '\n</tool_response>' -}}
{{- '' if before_tool else '<|im_end|>\n' -}}
{%- elif role == 'assistant' and message.get('tool_calls') -%}
{{- '<|im_start|>assistant\n' + text(message) -}}
{%- for call in message['tool_calls'] -%}
{%- set function = call['function'] if call['function'] is defined else call -%}
{%- set arguments = function['arguments'] -%}
{{- ('\n' if text(message) or not loop.first else '') + '<tool_call>\n{"name": ' + (function['name'] | tojson) -}}
{{- ', "arguments": ' + (arguments if arguments is string else arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif not (role == 'system' and tools) -%}
{{- '<|im_start|>' + role + '\n' + text(message) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()


def train_tokenizer(
    vocab_size: int, out_dir: Path, *, model_max_length: int = 2048, chat_format: str = "chatml"
) -> None:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens; write it to ``out_dir``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by
    ``transformers.AutoTokenizer``). No BOS is added on encode, so ``decode(encode(s)) == s``;
    the chat template is ChatML. ``chat_format="harmony"`` adds harmony's markers as special
    tokens, as gpt-oss's tokenizer has them (the server then renders and reads harmony). If the
    corpus runs out of merges before ``vocab_size``, the rest is filled with reserved special
    tokens, as real checkpoints pad theirs, so that the tokenizer's length always equals the
    model's embedding rows.
    """
    specials = SPECIAL_TOKENS + (HARMONY_TOKENS if chat_format == "harmony" else ())
    if vocab_size < NUM_BYTE_SYMBOLS + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {NUM_BYTE_SYMBOLS} "
            f"byte symbols + {len(specials)} special tokens = {NUM_BYTE_SYMBOLS + len(specials)} at least"
        )
    tokenizer = _train_bpe(vocab_size, specials)
    _pad_vocab(tokenizer, vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(model_max_length, specials), indent=2) + "\n", encoding="utf-8"
    )


def _train_bpe(vocab_size: int, specials: tuple[str, ...]) -> Tokenizer:
    """GPT-2-style byte-level BPE: no normaliser (it would break round-trips), no unknown token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a pair seen once is noise, not a merge worth having
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_corpus(), trainer=trainer)
    return tokenizer


def _stdlib_corpus() -> list[str]:
    """Slices of the stdlib's top-level modules, in sorted order, ``_CORPUS_CHARS`` in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    remaining = _CORPUS_CHARS
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = text[: min(_CHARS_PER_FILE, remaining)]
        texts.append(text)
        remaining -= len(text)
        if remaining == 0:
            break
    if not texts:
        raise RuntimeError(f"no Python sources in {stdlib} to train a tokenizer on")
    return texts


def _pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Fill the vocabulary up to ``vocab_size`` with ``<|reserved_N|>`` special tokens."""
    missing = vocab_size - tokenizer.get_vocab_size()
    reserved = [AddedToken(_RESERVED_TOKEN.format(i), special=True) for i in range(missing)]
    tokenizer.add_special_tokens(reserved)
    if (size := tokenizer.get_vocab_size()) != vocab_size:
        raise RuntimeError(f"the tokenizer has {size} tokens, not the {vocab_size} asked for")


def _tokenizer_config(model_max_length: int, specials: tuple[str, ...]) -> dict[str, object]:
    """The ``tokenizer_config.json`` that tells transformers how to wrap ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # Byte-level BPE needs none; said outright because transformers loads some model types'
        # tokenizers with their own class whatever tokenizer_class says (Qwen3.5's), whose default
        # unk token would otherwise be added past the embeddings' last row.
        "unk_token": None,
        "additional_special_tokens": list(specials[3:]),  # all but pad, bos and eos
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
