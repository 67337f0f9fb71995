"""HTTP plumbing the handlers share: bounded body reads, bearer auth, disconnect detection,
and merging several request streams into one.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from fastapi import Request

from moeserve.api.errors import APIError

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 once it passes `limit` bytes.

    A declared Content-Length over the limit is refused before reading anything; a chunked body
    is counted as it arrives, so a client can not make the server buffer more than `limit`.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"the request body has {declared} bytes; the limit is {limit}", status_code=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"the request body is over the limit of {limit} bytes", status_code=413)
        chunks.append(chunk)
    return b"".join(chunks)


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless `Authorization: Bearer <api_key>` (compared in constant time); no key, no check."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            "invalid or missing API key: send 'Authorization: Bearer <key>'", status_code=401, code="invalid_api_key"
        )


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (a non-streaming request would
    otherwise keep generating for nobody). Call only after the body has been read: this consumes
    the ASGI receive channel."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    One stream's error ends the merge with that error; leaving early cancels the readers.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((-1, exc))
        finally:
            await queue.put(None)

    readers = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(readers)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if index < 0:
                raise item  # type: ignore[misc]
            yield index, item  # type: ignore[misc]
    finally:
        for reader in readers:
            reader.cancel()
