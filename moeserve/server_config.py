"""How the HTTP server behaves, independent of the model it serves: the settings behind
`moeserve launch`'s server flags, which are generated from these fields (`moeserve.options`).

Imports no torch, so the command's parser can be built without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moeserve.engine_config import parse_bytes
from moeserve.options import option

DEMO_MODEL_NAME = "moeserve-demo"


@dataclass(frozen=True)
class ServerSettings:
    """The server's own knobs, one documented field and one default each."""

    served_model_name: str | None = None
    """Model id clients send and /v1/models lists; None: the --model path, or 'moeserve-demo'."""
    host: str = "127.0.0.1"
    """Address to listen on; the default is loopback only."""
    port: int = 8000
    """Port to listen on; 0 picks a free one (the log says which)."""
    api_key: str | None = option(None, env=("MOESERVE_API_KEY",))
    """Require 'Authorization: Bearer KEY' on /v1 routes; /health, /metrics and /version stay open."""
    max_body_bytes: int = option(16 * 1024**2, name="max_request_body", parse=parse_bytes)
    """Largest request body in bytes, e.g. 16MiB (413 beyond): a prompt of token ids for a 128k
    context fits."""
    shutdown_timeout_s: float = option(30.0, name="shutdown_timeout")
    """Seconds running requests get to finish after SIGTERM before they are aborted."""
    cpu_binding: Literal["auto", "off"] = "auto"
    """Model on CPU in one rank: auto binds the engine core and its torch threads to every CPU but
    one and the HTTP process to that one, so neither preempts the other (as vLLM's CPU build
    does); off leaves both to the OS."""

    tool_call_parser: Literal["hermes", "deepseek_v3"] | None = None
    """How tool calls are read from the model's text under tool_choice "auto": hermes
    (<tool_call>{json}</tool_call>, Qwen and many others) or deepseek_v3; None: "auto" is refused
    (a named function and "required" constrain the output instead and need no parser)."""

    reasoning_parser: Literal["deepseek_r1", "qwen3", "glm45"] | None = None
    """Read a reasoning model's <think>...</think> into `reasoning_content` (chat, streamed as
    `delta.reasoning_content`) and reasoning items (/v1/responses): deepseek_r1, qwen3 or glm45;
    None: the thinking stays in the content. Structured outputs then constrain the answer: the
    output may think first, freely, up to </think>."""

    responses_store_bytes: int = option(256 * 1024**2, parse=parse_bytes)
    """Memory for the responses /v1/responses keeps (with `store`, the default) for GET, DELETE
    and `previous_response_id`, e.g. 256MiB, counted as their JSON: the oldest dropped first, lost
    on restart; a chain's conversation is kept once. 0 stores none."""

    per_expert_metrics: bool = False
    """Label /metrics' routed-token counter by expert and its load-imbalance gauge by MoE layer: one
    series per expert and per layer, for debugging placement. Off: one counter, and the layers'
    mean and worst imbalance, a handful of series whatever the model's size."""

    def model_name(self, model: str | None) -> str:
        """The id to serve under: the one given, else the checkpoint path, else the demo's."""
        return self.served_model_name or model or DEMO_MODEL_NAME
