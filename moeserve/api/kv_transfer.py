"""The body's `kv_transfer_params` (as vLLM names it) on a disaggregated instance.

prefill: {"transfer_id": ID}                  hold the prompt's KV for ID
decode:  {"transfer_id": ID, "remote": "host:port", "model": FINGERPRINT, "block_size": N, "tp": N}
         load it from that prefill instance, which the router describes (its GET /kv/info)

The answer to such a request carries this instance's part of the time to first token back in its
own `kv_transfer_params`, for the router's TTFT split: a prefill instance's {queue_s, prefill_s},
a decode instance's {transfer_s, first_step_s} (`kv_transfer.phases`). A stream carries it in an
SSE comment before [DONE] (`: kv_transfer_params {...}`), which SSE clients skip, so the stream's
events stay those of a colocated server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from moeserve.api.errors import APIError
from moeserve.engine.outputs import RequestOutput
from moeserve.kv_transfer.identity import KvIdentity
from moeserve.kv_transfer.phases import DECODE_PHASES, PREFILL_PHASES, STREAM_PREFIX
from moeserve.sampling_params import KvTransferParams

PARAM = "kv_transfer_params"
DECODE_KEYS = ("transfer_id", "remote", "model", "block_size", "tp")


def kv_transfer_params(body: dict | None, identity: KvIdentity | None, n: int) -> KvTransferParams | None:
    """The request's transfer, checked against this instance; a 400 saying what is wrong."""
    if body is None:
        return None
    if identity is None:
        raise APIError(f"{PARAM} needs an instance launched with --role prefill or decode", param=PARAM)
    if n != 1:
        raise APIError(f"{PARAM} needs n = 1 (one sequence per transfer), got {n}", param=PARAM)
    if identity.role == "decode":
        missing = [key for key in DECODE_KEYS if key not in body]
        if missing:
            raise APIError(f"{PARAM} on a decode instance needs {', '.join(missing)}", param=PARAM)
        problems = identity.mismatches(body["model"], body["block_size"], body["tp"])
        if problems:
            raise APIError(
                f"KV handshake refused: the prefill instance at {body['remote']} has {'; '.join(problems)}",
                param=PARAM,
            )
    try:
        return KvTransferParams(body.get("transfer_id"), body.get("remote") if identity.role == "decode" else None)
    except ValueError as exc:
        raise APIError(str(exc), param=PARAM) from None


def phase_timings(outputs: Sequence[RequestOutput], identity: KvIdentity | None) -> dict[str, float] | None:
    """This instance's part of the request's TTFT, or None before a first token. A decode instance
    queues a request only once its KV has loaded, so its wait to be first scheduled is the transfer
    (with the pre-allocation and any wait for a batch slot)."""
    metrics = outputs[0].metrics if len(outputs) == 1 else None
    if identity is None or metrics is None or metrics.queue_time_s is None or metrics.ttft_s is None:
        return None
    names = PREFILL_PHASES if identity.role == "prefill" else DECODE_PHASES
    return dict(zip(names, (metrics.queue_time_s, metrics.ttft_s - metrics.queue_time_s), strict=True))


def with_phase_timings(body: dict, outputs: Sequence[RequestOutput], identity: KvIdentity | None) -> dict:
    """`body` with this instance's TTFT phases in its `kv_transfer_params`, where it has any."""
    timings = phase_timings(outputs, identity)
    return body if timings is None else {**body, PARAM: timings}


def phase_timings_event(outputs: Sequence[RequestOutput], identity: KvIdentity | None) -> str:
    """The SSE comment a stream ends with (before [DONE]), or nothing."""
    timings = phase_timings(outputs, identity)
    return "" if timings is None else f"{STREAM_PREFIX}{json.dumps(timings)}\n\n"
