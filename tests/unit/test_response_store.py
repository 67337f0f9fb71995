"""The Responses store (`api/response_store.py`): bounded in bytes, the oldest evicted first, a
chain's history kept once, and a 404's message that says an id was evicted (and why)."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from moeserve.api import ServerMetrics, ServerSettings, ServingState
from moeserve.api.response_store import ResponseStore
from moeserve.config import SLOConfig

KB = "x" * 1000


def _message(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def _chain(store: ResponseStore, links: int, prefix: str = "r") -> list[str]:
    """`links` responses, each continuing the previous one with a 1 KB question and answer."""
    ids, previous = [], None
    for i in range(links):
        response_id = f"{prefix}{i}"
        added = [_message("user", f"{i}?{KB}"), _message("assistant", f"{i}!{KB}")]
        store.put(response_id, {"id": response_id, "output": added[1]["content"]}, added, previous)
        ids.append(response_id)
        previous = store.get(response_id)
    return ids


def test_a_chain_keeps_its_history_once_and_reads_it_whole() -> None:
    store = ResponseStore(limit=1 << 30)
    ids = _chain(store, 50)
    last = store.get(ids[-1])
    assert [m["content"][: m["content"].index(KB)] for m in last.messages] == [
        f"{i}{mark}" for i in range(50) for mark in "?!"
    ]
    # Each link adds ~3 KB (its two messages and its body): linear in the chain, where copying
    # each link's whole history (the store before) took sum(2 KB * i) ~ 2.5 MB.
    copied = sum(len(json.dumps(store.get(i).messages)) for i in ids)
    assert store.size < 50 * 3_200 < copied / 10, (store.size, copied)
    for response_id in ids:
        assert store.delete(response_id)
    assert store.size == 0 and len(store) == 0


def test_the_store_stays_within_its_bytes_dropping_the_oldest_first() -> None:
    store = ResponseStore(limit=20_000)
    for i in range(100):  # unrelated responses of ~3 KB
        added = [_message("user", KB), _message("assistant", KB)]
        store.put(f"r{i}", {"id": f"r{i}", "output": KB}, added, None)
        assert store.size <= 20_000
    kept = [i for i in range(100) if store.get(f"r{i}") is not None]
    assert kept == list(range(100 - len(kept), 100)) and 4 <= len(kept) <= 7  # the newest, in order


def test_a_link_outlives_its_response_while_a_later_one_needs_it() -> None:
    store = ResponseStore(limit=1 << 30)
    first, second = _chain(store, 2)
    size = store.size
    store.delete(first)  # its body goes; its messages stay, as the second's history
    assert 0 < store.size < size
    assert len(store.get(second).messages) == 4
    store.delete(second)
    assert store.size == 0


def test_a_chain_continued_from_an_evicted_link_is_counted_again() -> None:
    """A request that read its history before the predecessor was evicted still stores it: the
    predecessor's messages are counted again, since the new response holds them."""
    store = ResponseStore(limit=7_000)
    (first,) = _chain(store, 1, "a")
    previous = store.get(first)
    _chain(store, 2, "b")  # evicts the first response, and with it its link
    assert store.get(first) is None
    store.put("c", {"id": "c"}, [_message("user", "more")], previous)
    assert store.get("c").messages[0] == previous.messages[0]
    assert store.size <= 7_000
    linked = store.size
    store.delete("c")
    assert store.size < linked - 2_000  # the first link's 2 KB went with its last holder


def test_an_evicted_id_is_reported_as_evicted_naming_the_budget() -> None:
    store = ResponseStore(limit=4_000)
    first, _ = _chain(store, 2)
    assert store.get(first) is None
    message = store.missing(first, "Previous response")
    assert message.startswith(f"Previous response with id '{first}' was evicted")
    assert "4000 bytes" in message and "--responses-store-bytes" in message
    assert store.missing("never") == "Response with id 'never' not found."


def test_an_empty_budget_stores_nothing() -> None:
    store = ResponseStore(limit=0)
    _chain(store, 3)
    assert len(store) == 0 and store.size == 0 and "not found" in store.missing("r0")


def test_the_gauge_reports_the_stores_bytes() -> None:
    metrics = ServerMetrics("m", SLOConfig())
    state = ServingState(ServerSettings(served_model_name="m", responses_store_bytes=1 << 20), metrics)
    _chain(state.responses, 3)

    def gauge() -> float:
        for family in text_string_to_metric_families(metrics.exposition().decode()):
            if family.name == "moeserve:responses_store_bytes":
                return family.samples[0].value
        raise AssertionError("no moeserve:responses_store_bytes")

    assert gauge() == state.responses.size > 6_000
    state.responses.delete("r2")
    assert gauge() == state.responses.size
