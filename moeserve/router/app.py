"""The router's HTTP app: each completion goes to a prefill instance (one token, its KV held there
for a transfer id) and then to a decode instance, which loads that KV and generates; the decode
instance's answer, streamed or not, goes back to the client unchanged.

A prefill instance that fails (unreachable, 5xx) is retried on another one; a decode instance
that fails before answering likewise (the prefill side still holds the KV). One that dies
mid-stream ends the client's stream with an error event. Health checks take a dead instance out
of the choice and bring it back once it answers again.

Both instances answer their part of the TTFT in `kv_transfer_params` (`kv_transfer.phases`): the
router records it per phase and takes it out of the answer the client gets; a stream's SSE comment
carrying it passes through (clients skip comments).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.api.errors import error_body, error_type_for
from moeserve.kv_transfer.phases import STREAM_PREFIX
from moeserve.router.instances import Instance, choose, identify, pairing_problems, prompt_prefix
from moeserve.router.metrics import RouterMetrics

logger = logging.getLogger("moeserve.router")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check would drown the log

PARAM = "kv_transfer_params"
STREAM_PREFIX_BYTES = STREAM_PREFIX.encode()
CHARS_PER_TOKEN = 4  # the router does not tokenize: load is estimated from the text's length


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    """How long start-up waits for every instance to answer (they may still be loading)."""


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type_for(status), param), status_code=status)


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"])
    return json.dumps(body.get("prompt", ""))


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefills = [Instance(url.rstrip("/"), "prefill") for url in config.prefill]
        self.decodes = [Instance(url.rstrip("/"), "decode") for url in config.decode]
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0))
        self._health_task: asyncio.Task | None = None

    @property
    def instances(self) -> list[Instance]:
        return self.prefills + self.decodes

    async def start(self) -> None:
        """Identify every instance and refuse mismatched pairs (ValueError with every reason)."""
        for instance in self.instances:
            await identify(self.client, instance, self.config.startup_timeout_s)
            instance.healthy = True
        problems = pairing_problems(self.prefills, self.decodes)
        if problems:
            raise ValueError("KV handshake refused: " + "; ".join(problems))
        self._health_task = asyncio.create_task(self._check_health())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.client.aclose()

    async def _check_health(self) -> None:
        """Every `health_interval_s`, each instance's health; nothing stops this loop but `close`
        (an instance that answers nonsense is only unhealthy)."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            for instance in self.instances:
                try:
                    healthy = await self._probe(instance)
                except Exception:  # noqa: BLE001 - one bad answer must not end health checking
                    logger.exception("health check of %s %s failed", instance.role, instance.url)
                    healthy = False
                if healthy != instance.healthy:
                    logger.warning("%s %s is %s", instance.role, instance.url, "back" if healthy else "down")
                instance.healthy = healthy
                self.metrics.healthy.labels(instance.url, instance.role).set(int(healthy))

    async def _probe(self, instance: Instance) -> bool:
        """Whether `instance` answers /health; one coming back is identified again (a restarted
        instance has a new side channel address) and must still pair with every peer."""
        try:
            if (await self.client.get(f"{instance.url}/health", timeout=2.0)).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        if instance.healthy:
            return True
        try:
            await identify(self.client, instance, timeout_s=0.0)
        except (ValueError, TypeError, httpx.HTTPError) as exc:
            logger.warning("%s %s answers but cannot be identified: %s", instance.role, instance.url, exc)
            return False
        pairs = (self.prefills, [instance]) if instance.role == "decode" else ([instance], self.decodes)
        problems = pairing_problems(*(self._identified(side) for side in pairs))
        if problems:
            logger.error("%s %s is back but refused: %s", instance.role, instance.url, "; ".join(problems))
            return False
        return True

    @staticmethod
    def _identified(instances: list[Instance]) -> list[Instance]:
        return [i for i in instances if i.identity is not None]

    # ---- a request ---------------------------------------------------------------------------

    async def generate(self, path: str, body: dict) -> Response:
        if body.get("n", 1) != 1:
            return _error("the router serves n = 1 only (one KV transfer per request)", 400, "n")
        if PARAM in body:
            return _error("kv_transfer_params is the router's to set", 400, PARAM)
        if choose(self.decodes) is None:  # checked first: a prefill would hold KV nobody comes for
            return _error("no decode instance could take the request", 503)
        started = time.monotonic()
        text = _prompt_text(body)
        tokens = max(1, len(text) // CHARS_PER_TOKEN)
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        prefilled = await self._prefill(path, body, transfer_id, prompt_prefix(text), tokens)
        if isinstance(prefilled, Response):
            return prefilled
        prefill_s = time.monotonic() - started
        self.metrics.prefill.observe(prefill_s)
        assert prefilled.identity is not None
        kv = {
            "transfer_id": transfer_id,
            "remote": prefilled.identity.kv_address,
            "model": prefilled.identity.model,
            "block_size": prefilled.identity.block_size,
            "tp": prefilled.identity.tp,
        }
        return await self._decode(path, {**body, "kv_transfer_params": kv}, tokens, started, time.monotonic())

    async def _prefill(self, path: str, body: dict, transfer_id: str, prefix: str, tokens: int) -> Instance | Response:
        """Run the prompt on a prefill instance (one token, KV held): the instance, or the response
        to give the client (its 4xx, or a 503 when no prefill instance could)."""
        prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"transfer_id": transfer_id}}
        for key in ("max_completion_tokens", "stream_options", "min_tokens"):
            prefill_body.pop(key, None)
        tried: list[Instance] = []
        while (instance := choose(self.prefills, prefix, tuple(tried))) is not None:
            tried.append(instance)
            response = await self._post(instance, path, prefill_body, tokens)
            if response is None:
                continue
            if response.status_code != 200:
                return Response(response.content, response.status_code, media_type="application/json")
            instance.remember(prefix)
            self._observe_phases(response.content)
            return instance
        return _error("no prefill instance could take the request", 503)

    async def _decode(self, path: str, body: dict, tokens: int, started: float, asked: float) -> Response:
        tried: list[Instance] = []
        while (instance := choose(self.decodes, None, tuple(tried))) is not None:
            tried.append(instance)
            if body.get("stream"):
                try:
                    return await self._stream(instance, path, body, tokens, started, asked)
                except httpx.HTTPError as exc:
                    self.failed(instance, exc)
                    continue
            response = await self._post(instance, path, body, tokens)
            if response is None:
                continue
            now = time.monotonic()
            self.metrics.decode_first.observe(now - asked)
            self.metrics.ttft.observe(now - started)
            content = self._observe_phases(response.content) if response.status_code == 200 else response.content
            return Response(content, response.status_code, media_type="application/json")
        return _error("no decode instance could take the request", 503)

    def _observe_phases(self, content: bytes) -> bytes:
        """Record the TTFT phases an instance's answer carries; the answer without them."""
        try:
            answer = json.loads(content)
        except json.JSONDecodeError:
            return content
        if not isinstance(answer, dict) or PARAM not in answer:
            return content
        self.metrics.observe_phases(answer.pop(PARAM))
        return json.dumps(answer).encode()

    async def _post(self, instance: Instance, path: str, body: dict, tokens: int) -> httpx.Response | None:
        """The instance's answer, or None when it failed (unreachable or 5xx): try another."""
        try:
            async with self._at(instance, tokens):
                response = await self.client.post(f"{instance.url}{path}", json=body)
        except httpx.HTTPError as exc:
            self.failed(instance, exc)
            return None
        if response.status_code >= 500:
            self.failed(instance, response.text)
            return None
        return response

    async def _stream(
        self, instance: Instance, path: str, body: dict, tokens: int, started: float, asked: float
    ) -> Response:
        """Open the decode instance's stream; raises httpx.HTTPError when it cannot be opened (the
        caller tries another), else passes its bytes through, ending with an error event if the
        instance dies mid-stream."""
        request = self.client.build_request("POST", f"{instance.url}{path}", json=body)
        at = self._at(instance, tokens)
        await at.__aenter__()
        try:
            response = await self.client.send(request, stream=True)
        except BaseException:
            await at.__aexit__(None, None, None)
            raise
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            await at.__aexit__(None, None, None)
            if response.status_code >= 500:
                raise httpx.HTTPStatusError(content.decode(errors="replace"), request=request, response=response)
            return Response(content, response.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            first = True
            lines = PhaseLines()
            try:
                async for chunk in response.aiter_raw():
                    if first:
                        now = time.monotonic()
                        self.metrics.decode_first.observe(now - asked)
                        self.metrics.ttft.observe(now - started)
                        first = False
                    for timings in lines.feed(chunk):
                        self.metrics.observe_phases(timings)
                    yield chunk
            except httpx.HTTPError as exc:
                self.failed(instance, exc)
                message = f"the decode instance failed mid-stream: {exc}"
                yield f"data: {json.dumps(error_body(message, 'internal_error'))}\n\ndata: [DONE]\n\n".encode()
            finally:
                await response.aclose()
                await at.__aexit__(None, None, None)

        return StreamingResponse(relay(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def _at(self, instance: Instance, tokens: int) -> AsyncIterator[None]:
        """Count a request in flight at `instance` (its load, the metrics) while it runs there."""
        labels = (instance.url, instance.role)
        self.metrics.requests.labels(*labels).inc()
        self.metrics.in_flight.labels(*labels).inc()
        instance.load_tokens += tokens
        try:
            yield
        finally:
            instance.load_tokens -= tokens
            self.metrics.in_flight.labels(*labels).dec()

    def failed(self, instance: Instance, why: object) -> None:
        logger.warning("%s %s failed a request: %s", instance.role, instance.url, why)
        self.metrics.failures.labels(instance.url, instance.role).inc()
        instance.healthy = False  # until the next health check finds it answering


class PhaseLines:
    """Finds the TTFT phases' comment in a stream's bytes, which arrive cut anywhere."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[object]:
        """The phases of every comment line `chunk` completes."""
        self._pending += chunk
        *complete, self._pending = self._pending.split(b"\n")
        found = []
        for line in complete:
            if line.startswith(STREAM_PREFIX_BYTES):
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(json.loads(line[len(STREAM_PREFIX_BYTES) :]))
        return found


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="moeserve router", docs_url=None, redoc_url=None)

    async def forward(raw: Request, path: str) -> Response:
        try:
            body = json.loads(await raw.body())
        except json.JSONDecodeError as exc:
            return _error(f"the body is not JSON: {exc}", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        return await router.generate(path, body)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await forward(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        tried: list[Instance] = []
        while (instance := choose(router.decodes, None, tuple(tried))) is not None:
            tried.append(instance)
            try:
                response = await router.client.get(f"{instance.url}/v1/models", timeout=10.0)
            except httpx.HTTPError as exc:
                router.failed(instance, exc)
                continue
            if response.status_code < 500:
                return Response(response.content, response.status_code, media_type="application/json")
            router.failed(instance, response.text)
        return _error("no decode instance is up", 503)

    @app.get("/health")
    async def health() -> Response:
        up = any(i.healthy for i in router.prefills) and any(i.healthy for i in router.decodes)
        return Response(status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app
