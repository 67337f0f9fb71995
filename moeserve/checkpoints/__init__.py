"""Tiny Hugging Face MoE checkpoints made locally: for tests, parity checks and the demo server.

The public names load on first use, so that `moeserve.checkpoints.spec` (what the `make-model`
command's flags are generated from) can be imported without torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeserve.checkpoints.builder import make_model
    from moeserve.checkpoints.demo import demo_model_path, random_demo_model_path
    from moeserve.checkpoints.spec import SUPPORTED_ARCHS, MakeModelSpec
    from moeserve.checkpoints.tokenizer import train_tokenizer

_LAZY = {
    "SUPPORTED_ARCHS": "spec",
    "MakeModelSpec": "spec",
    "demo_model_path": "demo",
    "random_demo_model_path": "demo",
    "make_model": "builder",
    "train_tokenizer": "tokenizer",
}

__all__ = [
    "SUPPORTED_ARCHS",
    "MakeModelSpec",
    "demo_model_path",
    "make_model",
    "random_demo_model_path",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"moeserve.checkpoints.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'moeserve.checkpoints' has no attribute {name!r}")
