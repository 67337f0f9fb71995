"""Disaggregation composed with the features users always turn on, with real NIXL over loopback:
prefix caching under block pressure (many requests over a few shared prefixes, a decode cache too
small for all of them at once, several in flight), structured outputs, n-gram drafts and a decode
instance at --ep 2, behind the router. Every output equals a colocated server's, and afterwards
neither side holds a block."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
import pytest
from disagg_utils import RouterProcess, streamed_text, wait_idle

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
COMMON = ("--block-size", "4", "--max-model-len", "80", "--max-num-seqs", "4", "--speculative-config", NGRAM)
DISAGG = ("--kv-transfer", "nixl", *COMMON)
DECODE_BLOCKS = 20
"""Per data-parallel group: one sequence of max_model_len; room for two of these requests at a time,
not four."""
PREFIXES = [
    "The fox and the dog met by the river at dawn; ",
    "A list of things the careful cat keeps: ",
    "Rules of the road, as the old driver said: ",
]
SUFFIXES = ["first,", "then again", "and the last one", "one more time"]
CHOICES = ["alpha fox", "beta dog", "gamma cat"]


class Deployment(NamedTuple):
    colocated: object
    prefill: object
    decoder: object
    router: RouterProcess


@pytest.fixture(scope="module")
def deployment(start_server, tmp_path_factory):
    colocated = start_server(*COMMON, wait=False)
    prefill = start_server("--role", "prefill", *DISAGG, wait=False)
    decoder = start_server(
        "--role", "decode", "--ep", "2", "--kv-cache-blocks", str(DECODE_BLOCKS), *DISAGG, wait=False
    )
    servers = (colocated, prefill, decoder)
    for server in servers:
        server.wait_healthy()
    router = RouterProcess([prefill.url], [decoder.url], tmp_path_factory.mktemp("router") / "router.log")
    router.wait_listening()
    yield Deployment(colocated, prefill, decoder, router)
    router.stop()
    for server in servers:
        server.stop()


def _bodies() -> list[dict]:
    """Every prompt twice over (a second pass finds its prefix cached on both sides), every third
    one under a grammar."""
    bodies = []
    for index, (prefix, suffix) in enumerate((p, s) for _ in range(2) for p in PREFIXES for s in SUFFIXES):
        body = {"model": "tiny", "prompt": prefix + suffix, "max_tokens": 12, "temperature": 0}
        if index % 3 == 0:
            body["guided_choice"] = CHOICES
        bodies.append(body)
    return bodies


def _text(url: str, body: dict) -> str:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_prefix_pressure_grammars_and_drafts_through_the_router_equal_the_colocated_server(deployment):
    bodies = _bodies()
    expected = [_text(deployment.colocated.url, body) for body in bodies]
    for body, text in zip(bodies, expected):
        if "guided_choice" in body:
            assert text in CHOICES, text  # the reference itself is under its grammar
    with ThreadPoolExecutor(6) as pool:
        routed = list(pool.map(lambda body: _text(deployment.router.url, body), bodies))
    mismatched = [(b["prompt"], "guided_choice" in b, e, r) for b, e, r in zip(bodies, expected, routed) if e != r]
    assert not mismatched, f"(prompt, under a grammar, colocated, routed) that differ: {mismatched}"

    decoded = deployment.decoder.metrics()
    assert decoded["moeserve:kv_transfer_bytes_total{role=decode}"] > 0
    assert decoded["moeserve:prefix_cache_hits_total"] > 0
    assert sum(v for k, v in decoded.items() if k.startswith("moeserve:spec_decode_num_draft_tokens")) > 0
    failures = {k: v for k, v in decoded.items() if k.startswith("moeserve:kv_transfer_failures_total") and v}
    assert not failures, failures  # every load waited for blocks in the queue instead of giving up
    wait_idle(deployment.prefill, deployment.decoder)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_is_enforced_on_the_decode_instance(deployment, stream):
    body = {"model": "tiny", "prompt": "Name an animal:", "max_tokens": 12, "temperature": 0, "guided_choice": CHOICES}
    expected = _text(deployment.colocated.url, body)
    assert expected in CHOICES
    if stream:
        assert streamed_text(deployment.router.url, "/v1/completions", body) == expected
    else:
        assert _text(deployment.router.url, body) == expected
