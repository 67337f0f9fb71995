"""Engine: the core (scheduler + executor stepping on token ids), the frontend (tokenize,
validate, detokenize, stats), the offline `LLMEngine` that joins them in one thread, and the
server's client of the core running in its own process."""

from moeserve.engine.core import EngineCore
from moeserve.engine.core_client import EngineCoreClient
from moeserve.engine.engine import LLMEngine
from moeserve.engine.frontend import EngineFrontend
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moeserve.engine.streams import EngineClient, EngineDeadError, RequestStream

__all__ = [
    "CompletionOutput",
    "EngineClient",
    "EngineCore",
    "EngineCoreClient",
    "EngineDeadError",
    "EngineFrontend",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestStream",
]
