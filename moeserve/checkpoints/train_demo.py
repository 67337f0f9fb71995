"""Train the built-in demo model on the Python standard library, so that the demo answers with text.

Why: a server whose first answer is random tokens looks broken. No model can be downloaded where
moeserve is built, but every Python install ships megabytes of English and code: the standard
library's sources and their docstrings. This script trains the demo MoE (the same Qwen3-MoE shape
as the random-weight `DEMO_SPEC`, with a larger vocabulary so that a token is a word rather than a
few letters: about 1M parameters, 2 MB in bfloat16) on that text, and writes a checkpoint that
moeserve ships as package data (`demo.demo_model_path`).

Two kinds of documents, mixed and cut into fixed windows:
- source files, whole, each ended by ``</s>``: completions continue Python code and docstrings;
- chat turns, one per documented public function or class (read with ``ast``, nothing imported):
  the user asks what ``module.name`` does, the assistant answers with the docstring's first
  paragraph and ends its turn with ``<|im_end|>``, rendered by the tokenizer's own chat template,
  so `/v1/chat/completions` answers in kind and stops by itself.

Reproducible: files are read in sorted order, every random draw comes from generators seeded by
``--seed``, and torch runs on a fixed number of threads, so the same Python and torch versions give
the same weights. Re-train with::

    python -m moeserve.checkpoints.train_demo --out moeserve/checkpoints/demo_model

The shipped weights: 1,500 steps of 8 windows of 128 tokens (1.5M tokens, half an epoch of the
sources), 522 s on one core of a busy 2-core machine; final loss 2.70 on the sources, 2.00 on the
chat turns (a uniform guess: ln 2048 = 7.6). ``--steps`` trades time for loss.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import math
import random
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from moeserve.checkpoints.builder import make_model
from moeserve.checkpoints.demo import DEMO_SPEC

logger = logging.getLogger("moeserve.checkpoints")

TRAINED_DEMO_SPEC = dataclasses.replace(DEMO_SPEC, vocab=2048, init_std=0.02, dtype="float32")
"""The random demo's shape with a word-sized vocabulary; float32 to train, saved as bfloat16.
HF's init (0.02) rather than the builder's 0.2, which suits untrained models only."""

_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
"""Installed packages are not the standard library; its test suites are mostly assertions."""


@dataclass(frozen=True)
class TrainDemoConfig:
    """How to train. The defaults are what the shipped demo was trained with."""

    seed: int = 0
    steps: int = 1500
    batch: int = 8
    context: int = 128
    """Tokens per training window; the demo answers best within this many."""
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    chat_fraction: float = 0.25
    """Share of training windows drawn from the chat turns rather than the sources."""
    max_source_chars: int = 8_000_000
    threads: int = 1
    """One: on a shared CPU, torch's threads wait on each other whenever one is descheduled."""


def train_demo(out_dir: Path, config: TrainDemoConfig) -> dict[str, float]:
    """Train the demo model per ``config`` and save it to ``out_dir``; return its final losses."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory() as staging:
        make_model(TRAINED_DEMO_SPEC, Path(staging))  # random init, tokenizer, generation config
        tokenizer = AutoTokenizer.from_pretrained(staging)
        # HF's reference loop over the experts: on a CPU it beats the grouped and batched kernels
        model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32, experts_implementation="eager")
    sources, chats = _token_streams(tokenizer, config)
    logger.info("corpus: %d source tokens, %d chat tokens", len(sources), len(chats))
    model.config.output_router_logits = True  # the load-balancing loss keeps every expert in use
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    rng = torch.Generator().manual_seed(config.seed)
    started = time.monotonic()
    recent: list[float] = []
    for step in range(1, config.steps + 1):
        batch = _batch(sources, chats, config, rng)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-50:]
        if step % 100 == 0 or step in (10, config.steps):
            logger.info("step %d/%d loss %.3f (%.0f s)", step, config.steps, _mean(recent), time.monotonic() - started)
    model.eval()
    losses = {name: _eval_loss(model, stream, config) for name, stream in (("source", sources), ("chat", chats))}
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size=DEMO_SPEC.max_shard_bytes)
    tokenizer.save_pretrained(out_dir)
    logger.info("saved to %s; final loss: %s", out_dir, losses)
    return losses


def _lr_factor(step: int, config: TrainDemoConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _batch(sources: torch.Tensor, chats: torch.Tensor, config: TrainDemoConfig, rng: torch.Generator) -> torch.Tensor:
    """``config.batch`` random windows of ``config.context`` tokens, some from each stream."""
    n_chat = round(config.batch * config.chat_fraction)
    windows = [_window(chats if i < n_chat else sources, config.context, rng) for i in range(config.batch)]
    return torch.stack(windows)


def _window(stream: torch.Tensor, length: int, rng: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, len(stream) - length, (1,), generator=rng))
    return stream[start : start + length]


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, stream: torch.Tensor, config: TrainDemoConfig) -> float:
    """Mean loss over 32 fixed windows (seeded apart from training's)."""
    rng = torch.Generator().manual_seed(config.seed + 1)
    batch = torch.stack([_window(stream, config.context, rng) for _ in range(32)])
    return round(model(input_ids=batch, labels=batch).loss.item(), 3)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _token_streams(tokenizer: PreTrainedTokenizerBase, config: TrainDemoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The source files and the chat turns, each shuffled (seeded) and concatenated as token ids."""
    files = list(_stdlib_files())
    sources: list[str] = []
    chats: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if total < config.max_source_chars:
            sources.append(text + tokenizer.eos_token)
            total += len(text)
        chats.extend(_chat_turns(tokenizer, path, text))
    shuffle = random.Random(config.seed)
    shuffle.shuffle(sources)
    shuffle.shuffle(chats)
    return _encode(tokenizer, sources), _encode(tokenizer, chats)


def _encode(tokenizer: PreTrainedTokenizerBase, documents: list[str]) -> torch.Tensor:
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return torch.tensor([token for doc in ids for token in doc], dtype=torch.long)


def _stdlib_files() -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted order, installed packages and tests left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if not _SKIPPED_DIRS.intersection(path.relative_to(stdlib).parts[:-1]):
            yield path


def _chat_turns(tokenizer: PreTrainedTokenizerBase, path: Path, text: str) -> Iterator[str]:
    """One rendered user/assistant exchange per public, documented top-level function or class."""
    module = _module_name(path)
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a few stdlib files are templates or Python 2 on purpose
        return
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        answer = doc.split("\n\n")[0].strip()
        messages = [
            {"role": "user", "content": f"What does {module}.{node.name} do?"},
            {"role": "assistant", "content": answer},
        ]
        yield tokenizer.apply_chat_template(messages, tokenize=False)


def _module_name(path: Path) -> str:
    """``json/decoder.py`` -> ``json.decoder``; a package's ``__init__.py`` -> the package."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = list(path.relative_to(stdlib).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint to (created)")
    defaults = TrainDemoConfig()
    for field in dataclasses.fields(TrainDemoConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = TrainDemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainDemoConfig)})
    train_demo(args.out, config)


if __name__ == "__main__":
    main()
