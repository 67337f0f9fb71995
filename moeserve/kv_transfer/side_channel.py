"""The KV side channel: a small HTTP server in the process that holds the engine core, and its
client. Over it a decode instance asks a prefill instance to push a request's blocks, and the
server reads the transfer metrics for its /metrics. JSON bodies; errors carry a `cause`.

    POST /kv/push     {transfer_id, dest: registration, dst_blocks, first_block, write_by}
                      -> {bytes, seconds} once the blocks are in the decode side's cache,
                         or an error once the transfer is known to be over (cancelled or never
                         started): a reply always means that nothing is being written any more
    GET  /kv/metrics  -> Prometheus text of `KvTransferStats`

A prefill rank process serves pushes of its own blocks the same way (`rank_writer`).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moeserve.kv_transfer.agent import KvTransferError

logger = logging.getLogger(__name__)

PushHandler = Callable[[dict], dict]

REPLY_GRACE_S = 5.0
"""How much longer than a write's deadline its asker waits for the reply: the writer cancels at the
deadline and answers only once the transfer has stopped, which takes a moment more."""

POLL_S = 0.05
"""How often the serving thread looks for `close()`: it waits that long at most (http.server's
default, 0.5 s, was most of an idle disaggregated engine core's stop)."""


class SideChannel:
    """Serves `push` (prefill role) and `metrics` (where given) on `host:port` from a daemon thread."""

    def __init__(self, host: str, port: int, metrics: Callable[[], bytes] | None, push: PushHandler | None) -> None:
        channel = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/kv/metrics" and metrics is not None:
                    self._reply(200, metrics(), "text/plain; version=0.0.4")
                else:
                    self._json(404, {"error": f"no route {self.path}", "cause": "refused"})

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/kv/push" or channel._push is None:
                    self._json(404, {"error": f"this instance takes no {self.path}", "cause": "refused"})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    self._json(200, channel._push(body))
                except KvTransferError as exc:
                    self._json(409, {"error": str(exc), "cause": exc.cause})
                except (ValueError, KeyError, TypeError) as exc:
                    self._json(400, {"error": f"bad push: {exc!r}", "cause": "refused"})
                except Exception as exc:  # noqa: BLE001 - the asker must hear back, whatever broke
                    logger.exception("KV push failed")
                    self._json(500, {"error": f"the push failed here: {exc!r}", "cause": "internal"})

            def _json(self, status: int, body: dict) -> None:
                self._reply(status, json.dumps(body).encode(), "application/json")

            def _reply(self, status: int, data: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                logger.debug("side channel: " + format, *args)

        self._push = push
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": POLL_S}, name="kv-side-channel", daemon=True
        )
        self._thread.start()
        logger.info("KV side channel on %s:%d", host, self._server.server_address[1])

    @property
    def address(self) -> str:
        """host:port as bound (the port chosen when asked for 0)."""
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def request_push(remote: str, body: dict, timeout_s: float) -> dict:
    """POST a push to the prefill instance at `remote` (host:port); its answer, or KvTransferError
    with the cause: unreachable (connection refused or dropped: the instance died), timeout, or
    what the prefill side refused."""
    host, port = remote.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=max(timeout_s, 0.001))
    try:
        connection.request("POST", "/kv/push", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    except TimeoutError as exc:
        raise KvTransferError(f"{remote} did not answer the push within {timeout_s:.1f} s", "timeout") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise KvTransferError(f"{remote} unreachable: {exc}", "unreachable") from exc
    finally:
        connection.close()
    try:
        answer = json.loads(data or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KvTransferError(
            f"{remote} answered the push with {response.status} and no JSON: {data[:80]!r}", "malformed"
        ) from exc
    if not isinstance(answer, dict):
        raise KvTransferError(f"{remote} answered the push with {response.status} and {answer!r}", "malformed")
    if response.status != 200:
        cause = answer.get("cause")
        raise KvTransferError(
            f"{remote} refused the push ({response.status}): {answer.get('error')}",
            cause if isinstance(cause, str) else "refused",
        )
    return answer


def reply_bytes(answer: dict, remote: str) -> int:
    """The bytes a successful push's `answer` reports moving; KvTransferError when it does not say."""
    num_bytes = answer.get("bytes")
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise KvTransferError(f"{remote} answered the push without a byte count: {answer!r}", "malformed")
    return num_bytes


def fetch_metrics(address: str, timeout_s: float = 2.0) -> bytes:
    """The side channel's metrics text, or nothing when it does not answer (the scrape goes on)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", "/kv/metrics")
        response = connection.getresponse()
        return response.read() if response.status == 200 else b""
    except OSError:
        return b""
    finally:
        connection.close()


def free_port(host: str) -> int:
    """A port free on `host` now, for a side channel asked to listen on port 0: the server must
    know it before the engine core (which listens) starts, to tell it to routers and peers."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
