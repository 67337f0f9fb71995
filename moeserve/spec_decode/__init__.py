"""Speculative decoding: cheap draft tokens proposed for a sequence, verified by one target forward.

`config`: the `speculative_config` option; `ngram`: prompt-lookup drafts (pure Python, proposed
by the scheduler from a sequence's own tokens, its state kept as they arrive); the runner verifies
them (`worker/verify_drafts.py`).
Imports no torch (the scheduler and the command's parser use the config and the proposer).
"""

from moeserve.spec_decode.config import SPECULATIVE_METHODS, SpeculativeConfig, parse_speculative_config
from moeserve.spec_decode.ngram import NgramProposer, can_draft, propose_ngram

__all__ = [
    "SPECULATIVE_METHODS",
    "NgramProposer",
    "SpeculativeConfig",
    "can_draft",
    "parse_speculative_config",
    "propose_ngram",
]
