"""Run the server: listen at once, load the model in the background, drain on SIGTERM.

Lifecycle:
1. Bind the socket and start uvicorn; /health answers 503 while the model loads in a thread.
2. The engine core process loads the model (`EngineCoreClient`); once it is ready /health turns
   200 and requests are served. A load failure is logged and the process exits 1, so an
   orchestrator sees it; so is a core that dies later (/health turns 503 at once).
3. SIGTERM or SIGINT: new requests get 503 and the listener closes; running requests have
   `shutdown_timeout_s` to finish; what is left is aborted, then the process exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from moeserve.api.app import build_app
from moeserve.api.harmony import speaks_harmony
from moeserve.api.metrics import ServerMetrics
from moeserve.api.state import ModelInfo, ServerSettings, ServingState
from moeserve.config import EngineConfig
from moeserve.engine.core_client import EngineCoreClient
from moeserve.engine.cpu_binding import CpuBinding, bind_current_process, plan_cpu_binding
from moeserve.engine.stats import LoggingStatLogger
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.kv_transfer.identity import KvIdentity, model_fingerprint
from moeserve.kv_transfer.side_channel import free_port
from moeserve.structured.compile_pool import GrammarCompilePool

logger = logging.getLogger("moeserve.server")


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which also stops admission the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServingState) -> None:
        super().__init__(config)
        self.serving = state

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.serving.draining:
            logger.info(
                "received %s: admitting no new requests; running ones have %.0f s to finish",
                signal.Signals(sig).name,
                self.serving.settings.shutdown_timeout_s,
            )
        self.serving.draining = True
        model = self.serving.model
        if model is not None and model.grammars is not None:
            model.grammars.shutdown()  # compiles are not drained: their requests get a 503 now
        super().handle_exit(sig, frame)


def load_engine(
    state: ServingState,
    config: EngineConfig,
    on_failure: Callable[[], None],
    binding: CpuBinding | None = None,
) -> None:
    """Start the engine core process (on `binding`'s CPUs, if given) and attach its client to
    `state`; on failure, now or later (the core died, a rank was lost), log why and call
    `on_failure`."""
    try:
        config = config.with_model_folder()
        logger.info("loading %s", config.model)

        def engine_died(error: BaseException) -> None:
            logger.error("the engine stopped (%s); shutting the server down", error)
            on_failure()

        engine = EngineCoreClient(
            config, stat_loggers=[state.metrics, LoggingStatLogger()], on_death=engine_died, binding=binding
        )
        engine.start()
        grammars = GrammarCompilePool(
            config.structured_outputs,
            load_tokenizer,
            config.model,
            engine.facts.model_config.vocab_size,
            engine.facts.eos_token_ids,
            cpus=() if binding is None else binding.frontend,
            on_timeout=state.metrics.compile_timeouts.inc,
        )
        tokenizer = load_tokenizer(Path(config.model))
        model = ModelInfo(
            max_model_len=engine.max_model_len,
            tokenizer=tokenizer,
            root=config.model,
            prompt_tokenizer=load_tokenizer(Path(config.model)),
            harmony=speaks_harmony(engine.facts.model_config.architecture, tokenizer),
            structured=config.structured_outputs,
            grammars=grammars,
            kv=kv_identity(config),
        )
        state.set_ready(engine, model)
        cfg = engine.facts.model_config
        logger.info(
            "serving %s as '%s': %s, %d layers, %d experts (top-%d), dtype %s, max_model_len %d, "
            "%d KV blocks of %d tokens, policy %s",
            config.model,
            state.settings.served_model_name,
            cfg.architecture,
            cfg.num_layers,
            cfg.num_experts,
            cfg.router.top_k,
            str(engine.facts.dtype).removeprefix("torch."),
            engine.max_model_len,
            engine.num_kv_blocks,
            config.cache.block_size,
            config.scheduling_policy,
        )
    except Exception as exc:  # noqa: BLE001 - any load failure ends the server, with the reason logged
        if isinstance(exc, (ValueError, RuntimeError)):
            logger.error("could not load the model: %s", exc)
        else:
            logger.exception("could not load the model")
        on_failure()


def kv_identity(config: EngineConfig) -> KvIdentity | None:
    """This instance as its disaggregation peers and the router see it (`--role`), else None."""
    kv = config.kv_transfer
    if not kv.enabled:
        return None
    assert config.model is not None
    model, block_size, parallel = model_fingerprint(config.model), config.cache.block_size, config.parallel
    return KvIdentity(kv.role, model, block_size, parallel.tp, parallel.ep, kv.address)


def serve(settings: ServerSettings, engine_config: EngineConfig) -> int:
    """Serve until a shutdown signal; returns the process exit code (0 after a clean drain)."""
    kv = engine_config.kv_transfer
    if kv.enabled and kv.port == 0:  # peers learn the port from /kv/info, so it is fixed before the core starts
        kv = dataclasses.replace(kv, port=free_port(kv.host))
        engine_config = dataclasses.replace(engine_config, kv_transfer=kv)
    metrics = ServerMetrics(settings.served_model_name, engine_config.slo, per_expert=settings.per_expert_metrics)
    state = ServingState(settings, metrics)
    config = uvicorn.Config(
        build_app(state),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        lifespan="off",
    )
    server = _DrainingServer(config, state)
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    bound_port = sock.getsockname()[1]
    logger.info("listening on http://%s:%d (health answers 503 until the model is loaded)", settings.host, bound_port)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", settings.host)

    binding = plan_cpu_binding(
        settings.cpu_binding, engine_config.device, engine_config.parallel.ep, os.sched_getaffinity(0)
    )
    if binding is not None:
        bind_current_process(binding.frontend)  # before any thread starts: they inherit it
        logger.info("CPU binding: %s (--cpu-binding off leaves them to the OS)", binding.describe())

    failed = threading.Event()

    def stop_after_failure() -> None:
        failed.set()
        server.should_exit = True

    threading.Thread(
        target=load_engine,
        args=(state, engine_config, stop_after_failure, binding),
        name="moeserve-loader",
        daemon=True,
    ).start()
    # uvicorn re-raises the shutdown signal once it has drained; absorb it so the exit code is ours.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if state.model is not None and state.model.grammars is not None:
        state.model.grammars.shutdown()  # a model loaded during the drain: its workers go too
    if state.engine is not None:
        state.engine.shutdown(timeout=10.0)
    if failed.is_set():
        return 1
    logger.info("shut down cleanly")
    return 0
