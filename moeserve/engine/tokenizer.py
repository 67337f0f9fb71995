"""The checkpoint's tokenizer, through transformers (tokenizer.json + chat template).

transformers' fast tokenizers are the de-facto reference for HF checkpoints: special-token
handling and Jinja chat templates match what the model was trained with, which is worth more
than a lighter dependency.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moeserve.models.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


def load_tokenizer(folder: str | Path):
    """A `PreTrainedTokenizerFast` from the checkpoint folder; never touches the network."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {e}") from None
