"""The checkpoint's tokenizer, through transformers (tokenizer.json + chat template).

transformers' fast tokenizers are the de-facto reference for HF checkpoints: special-token
handling and Jinja chat templates match what the model was trained with, which is worth more
than a lighter dependency. A release whose tokenizer is a tiktoken file behind custom code
(Kimi's) is converted into one (`tiktoken_release.py`); the checkpoint's code is never run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moeserve.engine.tiktoken_release import is_tiktoken_release, load_tiktoken_release
from moeserve.models.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


def load_tokenizer(folder: str | Path):
    """A `PreTrainedTokenizerFast` from the checkpoint folder; never touches the network."""
    from transformers import AutoTokenizer

    if is_tiktoken_release(Path(folder)):
        return load_tiktoken_release(Path(folder))
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {e}") from None
