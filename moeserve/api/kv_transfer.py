"""The body's `kv_transfer_params` (as vLLM names it) on a disaggregated instance.

prefill: {"transfer_id": ID}                  hold the prompt's KV for ID
decode:  {"transfer_id": ID, "remote": "host:port", "model": FINGERPRINT, "block_size": N, "tp": N}
         load it from that prefill instance, which the router describes (its GET /kv/info)
"""

from __future__ import annotations

from moeserve.api.errors import APIError
from moeserve.kv_transfer.identity import KvIdentity
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
