"""Tokenizers released as a tiktoken BPE file plus custom code, served without running that code.

Kimi-K2, K2-Thinking and K2.5 ship `tiktoken.model` (one `base64(token bytes) rank` per line),
`tokenization_kimi.py` (named by `auto_map` in tokenizer_config.json) and no `tokenizer.json`;
transformers loads them only by executing that file. Its code adds nothing a fast tokenizer
lacks: byte-level BPE over the ranks (the lowest-ranked adjacent pair merges first, a piece
already in the vocabulary taken whole), the text first split by the class's `pat_str`, and
`num_reserved_special_tokens` ids after the ranks for the special tokens, named by
tokenizer_config.json's `added_tokens_decoder` (`<|reserved_token_{id}|>` where it names none).
So the file is read as text, never run: the two class attributes are evaluated from its syntax
tree (string literals, `+` and `"|".join([...])`, as the release writes them), and the rest
becomes a `tokenizers` BPE inside a `PreTrainedTokenizerFast`, with the release's chat template,
so that the chat path, the detokenizer and structured output see an ordinary fast tokenizer.
"""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

from moeserve.models.checkpoint import CheckpointError

RANKS_FILE = "tiktoken.model"
RESERVED_NAME = "<|reserved_token_{}|>"
"""The reference's name of a reserved special id tokenizer_config.json names no token for."""


def is_tiktoken_release(folder: Path) -> bool:
    """A folder whose tokenizer is a tiktoken file behind custom code, with no `tokenizer.json`."""
    config = folder / "tokenizer_config.json"
    return (
        (folder / RANKS_FILE).is_file()
        and not (folder / "tokenizer.json").is_file()
        and config.is_file()
        and "AutoTokenizer" in json.loads(config.read_text()).get("auto_map", {})
    )


def load_tiktoken_release(folder: Path):
    """The release's tokenizer as a `PreTrainedTokenizerFast`; refusals name the file and field."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text())
    ranks = read_ranks(folder / RANKS_FILE)
    path, name = tokenizer_class(folder, config["auto_map"]["AutoTokenizer"])
    attributes = class_attributes(path, name)
    if not isinstance(attributes.get("pat_str"), str):
        raise CheckpointError(f"{path}: class {name} defines no string pat_str to split text with")
    special = special_tokens(config, len(ranks), attributes.get("num_reserved_special_tokens"))

    chars = _byte_chars()
    as_text = {token: "".join(chars[b] for b in token) for token in ranks}
    tokenizer = Tokenizer(
        BPE(
            vocab={as_text[token]: rank for token, rank in ranks.items()},
            merges=[(as_text[a], as_text[b]) for a, b in merges(ranks)],
            ignore_merges=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(attributes["pat_str"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False) for content in special])
    for content, token_id in special.items():
        if tokenizer.token_to_id(content) != token_id:
            raise CheckpointError(
                f"{folder / 'tokenizer_config.json'}: special token {content!r} (id {token_id}) is also a "
                f"token of {RANKS_FILE}"
            )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        name_or_path=str(folder),
        chat_template=_chat_template(folder, config),
        model_max_length=config.get("model_max_length", int(1e30)),
        clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
        **{
            role: _content(config[role])
            for role in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(role)
        },
    )


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: token bytes -> rank (its id), one `base64 rank` line each."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path} line {number} is not `<base64 token> <rank>`: {line[:80]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: the ranks of its {len(ranks)} tokens are not 0..{len(ranks) - 1}, each once")
    return ranks


def merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges that reproduce tiktoken's rule, in priority order: every split of each
    multi-byte token into two tokens, by the merged token's rank (tiktoken merges the adjacent
    pair whose concatenation ranks lowest), then by its left part's rank and its right's."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def special_tokens(config: dict, base: int, reserved: object) -> dict[str, int]:
    """content -> id of the special ids `base .. base + reserved` (`reserved` from the class;
    without it, up to the highest id tokenizer_config.json names)."""
    named = {int(i): _content(token) for i, token in config.get("added_tokens_decoder", {}).items()}
    if reserved is None:
        reserved = max(named, default=base - 1) + 1 - base
    if not isinstance(reserved, int) or reserved < 0:
        raise CheckpointError(f"num_reserved_special_tokens is {reserved!r}, not a count")
    outside = sorted(i for i in named if not base <= i < base + reserved)
    if outside:
        raise CheckpointError(
            f"tokenizer_config.json added_tokens_decoder names id {outside[0]}, outside the special ids "
            f"{base}..{base + reserved - 1} after {RANKS_FILE}'s {base} tokens"
        )
    return {named.get(i, RESERVED_NAME.format(i)): i for i in range(base, base + reserved)}


def tokenizer_class(folder: Path, reference: str | list) -> tuple[Path, str]:
    """(source file, class name) of the tokenizer class `auto_map` names (`module.Class`, or
    `[slow, fast]`, or either prefixed by the `repo--` it came from)."""
    named = next((r for r in reference if r), "") if isinstance(reference, list) else reference
    module, _, name = named.split("--")[-1].rpartition(".")
    path = folder / f"{module.replace('.', '/')}.py"
    if not path.is_file():
        raise CheckpointError(f"tokenizer_config.json auto_map names {module}.{name}, but {path} is missing")
    return path, name


def class_attributes(path: Path, name: str) -> dict[str, object]:
    """The literal class attributes of class `name` in `path`, read from its syntax tree without
    running it; an attribute whose value is not a literal expression is left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if found is None:
        raise CheckpointError(f"{path} defines no class {name} (tokenizer_config.json auto_map)")
    attributes = {}
    for statement in found.body:
        if isinstance(statement, ast.Assign | ast.AnnAssign) and statement.value is not None:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            try:
                value = _literal(statement.value)
            except ValueError:
                continue
            attributes.update({t.id: value for t in targets if isinstance(t, ast.Name)})
    return attributes


def _literal(node: ast.expr) -> object:
    """A constant, a `+` of two, or `"sep".join([...])` of constants; else ValueError."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal(node.left) + _literal(node.right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.List | ast.Tuple)
    ):
        return node.func.value.value.join(_literal(part) for part in node.args[0].elts)
    return ast.literal_eval(node)


def _chat_template(folder: Path, config: dict) -> str | None:
    """`chat_template.jinja` where the release has one, else tokenizer_config.json's template
    (one string, or the one named `default` of a list)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _content(token: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else token


def _byte_chars() -> list[str]:
    """The printable character byte-level BPE writes for each byte (GPT-2's table, which the
    `ByteLevel` pre-tokenizer applies): printable Latin-1 bytes stand for themselves, the rest
    take the code points from 256 up in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
