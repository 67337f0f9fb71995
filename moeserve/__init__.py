"""moeserve: an inference server for Mixture-of-Experts LLMs with expert parallelism.

    from moeserve import LLM, SamplingParams

The public names load on first use, so importing a light room (`moeserve.scheduler`, the
`moeserve` command's parser) does not pull in torch and the model runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeserve.engine.outputs import CompletionOutput, RequestOutput
    from moeserve.llm import LLM
    from moeserve.sampling_params import SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "llm",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "sampling_params",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"moeserve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
