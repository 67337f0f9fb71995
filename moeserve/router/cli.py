"""`moeserve router --prefill URL... --decode URL... [--host] [--port]`.

The parser is built on every `moeserve` call, so this module imports no more than argparse at
load: the router's app (FastAPI, uvicorn and the API's error format, which pull in torch) is
imported when a router runs, keeping `moeserve --help` light."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.router.app import RouterConfig

logger = logging.getLogger("moeserve.router")


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the OpenAI endpoint in front of prefill and decode instances")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (--role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (--role decode)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0: a free one (default: 8000)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks (default: 2)")
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from moeserve.router.app import RouterConfig

    config = RouterConfig(tuple(args.prefill), tuple(args.decode), health_interval_s=args.health_interval)
    return asyncio.run(_serve(config, args.host, args.port))


async def _serve(config: RouterConfig, host: str, port: int) -> int:
    import uvicorn

    from moeserve.router.app import Router, build_router_app

    router = Router(config)
    try:
        await router.start()
    except (ValueError, OSError) as exc:  # httpx's connection errors are OSErrors' kin: both mean "cannot pair"
        logger.error("%s", exc)
        await router.close()
        return 2
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    logger.info(
        "router listening on http://%s:%d: %d prefill, %d decode instance(s)",
        host,
        sock.getsockname()[1],
        len(config.prefill),
        len(config.decode),
    )
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_config=None, access_log=False, lifespan="off"))
    try:
        await server.serve(sockets=[sock])
    finally:
        await router.close()
    return 0
