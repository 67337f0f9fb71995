"""KV transfer pieces without servers: block layouts, the block manager's pins and loaded
blocks, the scheduler's holds, a real NIXL write between two agents, and the handshake."""

from __future__ import annotations

import time

import pytest
import torch

from moeserve.cache_spec import PagedSpec, StateSpec
from moeserve.kv_transfer.agent import KvAgent, KvRegistration, KvTransferError
from moeserve.kv_transfer.identity import KvIdentity
from moeserve.kv_transfer.layout import KvLayout, paired_runs
from moeserve.kv_transfer.rank_writer import RankWriter, serve_writes
from moeserve.models.v4.cache import allocate as allocate_v4_layer
from moeserve.ops.state_batch import LinearState
from moeserve.router.app import PhaseLines
from moeserve.router.instances import Instance, choose, pairing_problems
from moeserve.router.metrics import RouterMetrics
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, Scheduler, SchedulerConfig


def _request(request_id: str, num_tokens: int, max_tokens: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, list(range(1, num_tokens + 1)), params, (0,), 0.0)


def test_paired_runs_merge_blocks_consecutive_on_both_sides():
    assert paired_runs([3, 4, 5, 9], [0, 1, 7, 8]) == ([(3, 2), (5, 1), (9, 1)], [(0, 2), (7, 1), (8, 1)])
    with pytest.raises(ValueError):
        paired_runs([1], [1, 2])


def test_layout_of_gqa_and_mla_caches():
    gqa = [torch.zeros(2, 10, 4, 2, 8) for _ in range(3)]  # K and V planes
    layout = KvLayout.of(gqa)
    assert (layout.planes, layout.block_bytes, layout.plane_bytes) == (2, 4 * 2 * 8 * 4, 10 * 4 * 2 * 8 * 4)
    value_block_7 = gqa[1][1, 7].data_ptr()
    assert (value_block_7, 2 * layout.block_bytes, 0) in layout.regions([(7, 2)])
    mla = KvLayout.of([torch.zeros(10, 4, 24)])
    assert (mla.planes, mla.block_bytes, mla.shape_key) == (1, 4 * 24 * 4, (1, 1, 4 * 24 * 4, (), 0))
    assert KvLayout.from_json(layout.to_json()) == layout
    from_before_groups = {k: v for k, v in layout.to_json().items() if k != "group"}  # a peer of an older build
    assert KvLayout.from_json(from_before_groups) == layout


@pytest.mark.parametrize("shape", [(2, 12, 4, 2, 8), (12, 4, 24)], ids=["gqa", "mla"])
def test_agent_writes_blocks_into_another_agents_cache(shape):
    source = [torch.randn(shape) for _ in range(2)]
    dest = [torch.zeros(shape) for _ in range(2)]
    writer, reader = KvAgent(source, "test-src"), KvAgent(dest, "test-dst")
    num_bytes = writer.write(reader.registration, ([2, 3, 7],), ([5, 6, 0],), write_by=time.time() + 10)
    block_dim = 1 if len(shape) == 5 else 0
    for src_cache, dst_cache in zip(source, dest):
        for s, d in ((2, 5), (3, 6), (7, 0)):
            assert torch.equal(dst_cache.select(block_dim, d), src_cache.select(block_dim, s))
        untouched = [b for b in range(12) if b not in (5, 6, 0)]
        assert not dst_cache.index_select(block_dim, torch.tensor(untouched)).any()
    assert num_bytes == 3 * writer.layouts[0].block_bytes * writer.layouts[0].planes * 2
    other = KvAgent([torch.zeros(12, 8, 24)], "test-other")
    with pytest.raises(KvTransferError, match="KV layouts differ") as refused:
        writer.write(other.registration, ([0],), ([0],), write_by=time.time() + 10)
    assert refused.value.cause == "layout"


def test_a_dsa_models_indexer_keys_move_with_its_latents():
    """DeepSeek-V3.2 / GLM-5: layers 0 and 2 keep (latent, indexer keys), layer 1 its latent only.
    One layout per kind of tensor, in order; a write moves the same blocks of every tensor, and
    the registration round-trips through JSON."""

    def caches(make):
        return [(make(12, 4, 24), make(12, 4, 16)), make(12, 4, 24), (make(12, 4, 24), make(12, 4, 16))]

    source, dest = caches(torch.randn), caches(torch.zeros)
    writer, reader = KvAgent(source, "test-dsa-src"), KvAgent(dest, "test-dsa-dst")
    assert [(len(x.layer_bases), x.block_bytes) for x in writer.layouts] == [(3, 4 * 24 * 4), (2, 4 * 16 * 4)]
    assert KvRegistration.from_json(reader.registration.to_json()).layouts == reader.layouts
    num_bytes = writer.write(reader.registration, ([2, 3],), ([5, 9],), write_by=time.time() + 10)
    assert num_bytes == 2 * 4 * 4 * (3 * 24 + 2 * 16)
    flat = [
        (s, d)
        for src, dst in zip(source, dest)
        for s, d in zip(*(x if isinstance(x, tuple) else (x,) for x in (src, dst)))
    ]
    for src_cache, dst_cache in flat:
        assert torch.equal(dst_cache[[5, 9]], src_cache[[2, 3]])
        assert not dst_cache[[b for b in range(12) if b not in (5, 9)]].any()
    latents_only = KvAgent([torch.zeros(12, 4, 24)] * 3, "test-dsa-other")
    with pytest.raises(KvTransferError, match="KV layouts differ"):
        writer.write(latents_only.registration, ([0],), ([0],), write_by=time.time() + 10)


def _hybrid_caches(fill) -> list:
    """A GQA layer's blocks and two Gated DeltaNet layers' states with 3 saved-state slots."""
    states = [
        LinearState(
            torch.zeros(2, 6, 3), torch.zeros(2, 2, 4, 4), saved_conv=fill(3, 6, 3), saved_recurrent=fill(3, 2, 4, 4)
        )
        for _ in range(2)
    ]
    return [states[0], fill(2, 12, 4, 2, 8), states[1]]


def _v4_caches(fill) -> list:
    """A window-only layer and a compressed one (4 per entry, with an open-window state and 2
    saved slots): both groups' tensors of one shape, 6 blocks of 4 rows of 8."""
    window = PagedSpec((), (8,), "float32", window=8)
    entries = PagedSpec((), (8,), "float32", tokens_per_entry=4)
    state = StateSpec(((3, 8),), ("float32",))
    pools = {window.group_key: 6, entries.group_key: 6}
    caches = [allocate_v4_layer(specs, pools, 4, 1, num_saved=2) for specs in ((window,), (window, entries, state))]
    for tensor in (t for c in caches for t in (*c.paged, *c.saved)):
        tensor.copy_(fill(tensor.shape))
    return caches


def test_a_grouped_write_moves_each_groups_blocks_by_its_own_ids_and_the_saved_states():
    """Tensors of one shape in two groups are two layouts, each moved by its group's ids."""
    source, dest = _v4_caches(torch.randn), _v4_caches(torch.zeros)
    writer, reader = KvAgent(source, "test-v4-src"), KvAgent(dest, "test-v4-dst")
    assert [x.group for x in writer.layouts] == [0, 1] and writer.layouts[0].state_slot_bytes == (3 * 8 * 4,)
    num_bytes = writer.write(reader.registration, ([4], [2]), ([1], [5]), write_by=time.time() + 10, states=(1, 0))
    assert num_bytes == 3 * 4 * 8 * 4 + 3 * 8 * 4  # three blocks (two layers' windows, one's entries), one state
    for src, dst in zip(source, dest, strict=True):
        assert torch.equal(dst.window[1], src.window[4]) and dst.window.count_nonzero() == 4 * 8
    assert torch.equal(dest[1].entries[5], source[1].entries[2]) and dest[1].entries.count_nonzero() == 4 * 8
    assert torch.equal(dest[1].saved[0][0], source[1].saved[0][1]) and not dest[1].saved[0][1].any()


def test_a_write_carries_a_saved_state_of_every_state_layer():
    source, dest = _hybrid_caches(torch.randn), _hybrid_caches(torch.zeros)
    writer, reader = KvAgent(source, "test-hybrid-src"), KvAgent(dest, "test-hybrid-dst")
    (layout,) = writer.layouts
    assert KvLayout.from_json(layout.to_json()) == layout
    channel = serve_writes(writer, "127.0.0.1")  # the rank's path passes the slots on as the core's does
    try:
        num_bytes = RankWriter(channel.address).write(
            reader.registration, ([4],), ([9],), write_by=time.time() + 10, states=(2, 0)
        )
    finally:
        channel.close()
    assert torch.equal(dest[1][:, 9], source[1][:, 4]) and not dest[1][:, :9].any()
    for src_state, dst_state in ((source[0], dest[0]), (source[2], dest[2])):
        for saved in ("saved_conv", "saved_recurrent"):
            src, dst = getattr(src_state, saved), getattr(dst_state, saved)
            assert torch.equal(dst[0], src[2]) and not dst[1:].any()
    state_bytes = 2 * (6 * 3 + 2 * 4 * 4) * 4
    assert num_bytes == layout.block_bytes * 2 + state_bytes
    assert writer.write(reader.registration, ([4],), ([9],), write_by=time.time() + 10) == layout.block_bytes * 2
    fewer = KvAgent(_hybrid_caches(torch.zeros)[1:], "test-hybrid-fewer")
    with pytest.raises(KvTransferError, match="KV layouts differ"):
        writer.write(fewer.registration, ([0],), ([0],), write_by=time.time() + 10, states=(0, 0))


def test_a_rank_writes_its_blocks_when_the_core_asks_over_its_side_channel():
    source = [torch.randn(2, 12, 4, 2, 8) for _ in range(2)]
    dest = [torch.zeros(2, 12, 4, 2, 8) for _ in range(2)]
    rank_agent, reader = KvAgent(source, "test-rank"), KvAgent(dest, "test-decode")
    channel = serve_writes(rank_agent, "127.0.0.1")
    try:
        writer = RankWriter(channel.address)
        assert (
            writer.write(reader.registration, ([4, 5],), ([1, 9],), write_by=time.time() + 10)
            == 2 * rank_agent.layouts[0].block_bytes * 4
        )
        for src_cache, dst_cache in zip(source, dest):
            assert torch.equal(dst_cache[:, 1], src_cache[:, 4]) and torch.equal(dst_cache[:, 9], src_cache[:, 5])
        other = KvAgent([torch.zeros(12, 8, 24)], "test-other")
        with pytest.raises(KvTransferError, match="KV layouts differ") as refused:
            writer.write(other.registration, ([0],), ([0],), write_by=time.time() + 10)
        assert refused.value.cause == "layout"  # the rank's cause reaches the core
    finally:
        channel.close()
    with pytest.raises(KvTransferError) as gone:
        writer.write(reader.registration, ([0],), ([0],), write_by=time.time() + 1)
    assert gone.value.cause == "unreachable"


def test_the_router_reads_ttft_phases_from_answers_and_stream_comments():
    lines = PhaseLines()
    stream = b'data: {"x": 1}\n\n: kv_transfer_params {"transfer_s": 0.25, "first_step_s": 0.5}\n\ndata: [DONE]\n\n'
    found = [timings for i in range(0, len(stream), 7) for timings in lines.feed(stream[i : i + 7])]
    assert found == [{"transfer_s": 0.25, "first_step_s": 0.5}]
    metrics = RouterMetrics()
    metrics.observe_phases(found[0])
    metrics.observe_phases({"queue_s": 0.125, "prefill_s": 1.0, "transfer_s": "bad", "unknown_s": 3})
    metrics.observe_phases(["not", "a", "dict"])
    text = metrics.exposition().decode()
    for phase, count, total in [
        ("prefill_queue", 1, 0.125),
        ("prefill", 1, 1.0),
        ("transfer", 1, 0.25),
        ("first_decode_step", 1, 0.5),
    ]:
        assert f'moeserve_router:ttft_phase_seconds_count{{phase="{phase}"}} {float(count)}' in text
        assert f'moeserve_router:ttft_phase_seconds_sum{{phase="{phase}"}} {total}' in text


def test_a_write_past_its_deadline_moves_nothing():
    source, dest = [torch.randn(2, 12, 4, 2, 8)], [torch.zeros(2, 12, 4, 2, 8)]
    writer, reader = KvAgent(source, "test-late-src"), KvAgent(dest, "test-late-dst")
    with pytest.raises(KvTransferError, match="after its deadline") as late:
        writer.write(reader.registration, ([1],), ([2],), write_by=time.time() - 0.01)
    assert late.value.cause == "timeout" and not dest[0].any()


@pytest.mark.parametrize("has_state", [False, True], ids=["paged", "state"])
def test_a_prefill_request_leaves_its_full_blocks_held(has_state):
    """A model with state layers also holds the state saved at the prompt's last full block
    (its prompt is cut there), pinned against eviction until the push has read it."""
    config = SchedulerConfig(
        max_num_seqs=2, max_model_len=64, block_size=4, num_kv_blocks=16, has_state=has_state, num_saved_states=1
    )
    scheduler = Scheduler(config)
    request = _request("p", 10)
    request.kv_hold_id = "xfer-1"
    scheduler.add_request(request)
    finished = []
    while not finished:
        plan = scheduler.schedule()
        finished = scheduler.update(plan, {s.request_id: 5 for s in plan.scheduled if s.sample})
    assert finished[0].finish_reason == "length"
    ((transfer_id, held, state_slot),) = scheduler.kv_holds
    assert transfer_id == "xfer-1" and len(held) == (10 - 1) // 4 and state_slot == (0 if has_state else -1)
    assert scheduler.block_manager.num_used_blocks == len(held)
    scheduler.block_manager.unpin(held)
    assert scheduler.block_manager.num_used_blocks == 0
    if has_state:
        assert scheduler.block_manager.saved_states.reserve(b"other") is None  # pinned: not evicted
        scheduler.block_manager.saved_states.unpin(state_slot)
        assert scheduler.block_manager.saved_states.reserve(b"other") == 0


def test_handshake_mismatches_and_router_pairing():
    decode = KvIdentity("decode", "abc", 16, 1, 2, "127.0.0.1:1")
    assert decode.mismatches("abc", 16, 1) == []
    problems = decode.mismatches("xyz", 8, 2)
    assert [p.split(" (")[0] for p in problems] == ["a different model", "a different block size", "a different --tp"]
    prefill = Instance("http://p", "prefill", KvIdentity("prefill", "abc", 8, 1, 1, "127.0.0.1:2"))
    (problem,) = pairing_problems([prefill], [Instance("http://d", "decode", decode)])
    assert problem.startswith("prefill http://p and decode http://d: a different block size")


def test_router_choice_by_load_and_cached_prefix():
    a, b = Instance("http://a", "prefill", healthy=True), Instance("http://b", "prefill", healthy=True)
    a.load_tokens, b.load_tokens = 100, 10
    assert choose([a, b]) is b
    a.remember("head")
    assert choose([a, b], "head") is a  # its cache likely holds the prompt's head, and it is not swamped
    a.load_tokens = 10_000
    assert choose([a, b], "head") is b
    b.healthy = False
    assert choose([a, b], None, excluded=(a,)) is None
