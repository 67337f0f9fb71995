"""The TTFT phases a disaggregated instance reports back to the router, by their wire names.

Each instance times its own part of a request's time to first token and answers it in the
response's `kv_transfer_params` (a stream: in an SSE comment line starting with `STREAM_PREFIX`,
before [DONE]); the router labels its histogram with the phase names. No torch here: the router
reads these.
"""

from __future__ import annotations

PREFILL_PHASES = ("queue_s", "prefill_s")
"""A prefill instance's: the wait to be scheduled, then the prefill up to its one token."""
DECODE_PHASES = ("transfer_s", "first_step_s")
"""A decode instance's: arrival to first schedule (the KV load in it), then the first decode step."""
PHASE_LABELS = {
    "queue_s": "prefill_queue",
    "prefill_s": "prefill",
    "transfer_s": "transfer",
    "first_step_s": "first_decode_step",
}
STREAM_PREFIX = ": kv_transfer_params "
