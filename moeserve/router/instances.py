"""The router's view of its instances: who they are (GET /kv/info), whether they answer, how
loaded they are. A prefill and a decode instance are paired only when their identities match;
a mismatch is refused at start-up, with the reason, before any request could get wrong tokens."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx

from moeserve.kv_transfer.identity import KvIdentity

PREFIX_CHARS = 256  # a prompt's first characters say which prefill instance may have it cached
REMEMBERED_PREFIXES = 4096  # per prefill instance


@dataclass
class Instance:
    url: str
    role: str
    identity: KvIdentity | None = None
    healthy: bool = False
    load_tokens: int = 0
    """Estimated tokens of the requests the router has in flight there."""
    prefixes: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Prompt heads recently sent here (prefill), most recent last: its prefix cache likely has them."""

    def remember(self, prefix: str) -> None:
        self.prefixes[prefix] = None
        self.prefixes.move_to_end(prefix)
        while len(self.prefixes) > REMEMBERED_PREFIXES:
            self.prefixes.popitem(last=False)


def prompt_prefix(text: str) -> str:
    return hashlib.sha1(text[:PREFIX_CHARS].encode()).hexdigest()


async def identify(client: httpx.AsyncClient, instance: Instance, timeout_s: float) -> None:
    """Read the instance's identity, waiting up to `timeout_s` for it to answer and load its model;
    ValueError when it is not a disaggregated instance of the role it was given as."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = await client.get(f"{instance.url}/kv/info")
            if response.status_code != 503:  # 503: still loading
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"{instance.url} did not answer GET /kv/info within {timeout_s:.0f} s")
        await asyncio.sleep(1.0)
    if response.status_code != 200:
        status = response.status_code
        raise ValueError(f"{instance.url} is not a disaggregated instance: GET /kv/info answered {status}")
    identity = KvIdentity(**response.json())
    if identity.role != instance.role:
        raise ValueError(f"{instance.url} was given as --{instance.role} but runs --role {identity.role}")
    instance.identity = identity


def pairing_problems(prefills: list[Instance], decodes: list[Instance]) -> list[str]:
    """Every prefill/decode pair that could not move KV, and why."""
    problems = []
    for p in prefills:
        for d in decodes:
            assert p.identity is not None and d.identity is not None
            for reason in d.identity.mismatches(p.identity.model, p.identity.block_size, p.identity.tp):
                problems.append(f"prefill {p.url} and decode {d.url}: {reason}")
    return problems


def choose(
    instances: list[Instance], prefix: str | None = None, excluded: tuple[Instance, ...] = ()
) -> Instance | None:
    """The healthy instance with the least load in tokens; for prefill, one that recently took the
    same prompt head wins unless it carries more than twice the least load (plus a prompt's worth)."""
    candidates = [i for i in instances if i.healthy and i not in excluded]
    if not candidates:
        return None
    least = min(candidates, key=lambda i: i.load_tokens)
    if prefix is not None:
        cached = [i for i in candidates if prefix in i.prefixes]
        if cached:
            best = min(cached, key=lambda i: i.load_tokens)
            if best.load_tokens <= 2 * least.load_tokens + PREFIX_CHARS:
                return best
    return least
