"""Logical vs physical experts: the map, its placement file, the device table, and an MoE layer
whose experts live in shuffled, replicated slots computing exactly what the plain one does."""

from __future__ import annotations

import pytest
import torch

from moeserve.dispatch import ExpertMap, ReplicaTable, create_dispatcher
from moeserve.dispatch.expert_load import logical_rows
from moeserve.models import load_model
from moeserve.models.layers.router import HashRouter


def test_default_map_is_identity_without_redundant_experts():
    assert ExpertMap.default(8, 0, 4, 2).is_identity
    replicated = ExpertMap.default(8, 4, 4, 2)
    assert not replicated.is_identity
    assert replicated.replicas(0)[:5] == ((0, 8), (1, 9), (2, 10), (3, 11), (4,))
    assert replicated.local_logical(1, 3) == (1, 2, 3)  # slots 9, 10, 11
    assert replicated.rank_loads(0, [6.0, 0, 0, 0, 0, 0, 0, 0]) == [3.0, 0.0, 3.0, 0.0]


def test_placement_file_round_trip_and_errors(tmp_path):
    expert_map = ExpertMap(((3, 0, 1, 2, 3, 3),), 4, 2)
    path = tmp_path / "placement.json"
    expert_map.save(path)
    assert ExpertMap.load(path) == expert_map
    assert ExpertMap.initial(4, 1, 2, 2, str(path)) == expert_map
    with pytest.raises(ValueError, match="2 redundant experts; --num-redundant-experts is 1"):
        ExpertMap.initial(4, 1, 2, 1, str(path))
    with pytest.raises(ValueError, match="for 4 experts, 1 MoE layers and ep=2"):
        ExpertMap.initial(4, 1, 4, 2, str(path))
    with pytest.raises(ValueError, match="without a slot"):
        ExpertMap(((0, 0, 1, 2),), 4, 2)
    with pytest.raises(ValueError, match="outside"):
        ExpertMap(((0, 1, 2, 4),), 4, 2)
    with pytest.raises(ValueError, match="the split must be"):
        ExpertMap.from_json({"num_logical_experts": 4, "ep": 2, "layers": [[[0], [1, 2, 3]]]})
    with pytest.raises(ValueError, match="needs num_logical_experts"):
        ExpertMap.from_json({"ep": 2})
    with pytest.raises(ValueError, match="cannot read"):
        ExpertMap.load(tmp_path / "missing.json")


def test_replica_table_spreads_a_hot_expert_evenly():
    expert_map = ExpertMap(((0, 1, 0, 2, 0, 3),), 4, 2)  # expert 0 in slots 0, 2 and 4
    for rank in range(2):
        table = ReplicaTable(expert_map.replicas(0), rank, "cpu")
        ids = torch.tensor([[0, 1]] * 4 + [[2, 3], [1, 0]] + [[3, 0]] * 3)  # [T, K] logical
        slots = table.physical(ids)
        assert slots[:4, 1].tolist() == [1] * 4 and slots[4].tolist() == [3, 5]
        expert0 = slots[ids == 0]  # its 8 pairs in (token, k) order: round robin from replica `rank`
        assert expert0.tolist() == [(0, 2, 4)[(i + rank) % 3] for i in range(8)]


@pytest.fixture
def one_thread():
    """CPU GEMMs of a few rows may round differently from the same rows in a larger batch when
    several threads split the work; replicas split an expert's rows, so compare on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_moe_layer_with_shuffled_replicas_is_bit_equal(make_checkpoint, one_thread):
    """Every MoE block of a model whose 8 experts sit in 12 shuffled slots (four replicated)
    returns exactly the plain model's output: the slots got the right weights, each pair went to
    a replica, and combine summed each token's three rows in logical order."""
    folder = make_checkpoint("qwen3_moe", 7, num_experts=8, num_experts_per_tok=3)
    layer = (5, 0, 7, 2, 5, 1, 6, 3, 4, 0, 7, 5)
    expert_map = ExpertMap((layer, tuple(reversed(layer))), 8, 1)
    plain = load_model(folder)
    dispatcher = create_dispatcher("local", expert_map.slot_placement())
    shuffled = load_model(folder, dispatcher=dispatcher, expert_map=expert_map)
    x = torch.randn(37, plain.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, (ours, theirs) in enumerate(zip(shuffled.moe_blocks(), plain.moe_blocks())):
        assert ours.experts.w13.shape[0] == 12
        assert torch.equal(ours(x), theirs(x))
        for slots in expert_map.replicas(i):  # every replica served some of its expert's rows
            if theirs.routed_tokens[expert_map.physical_to_logical[i][slots[0]]] >= len(slots):
                assert (ours.routed_tokens[list(slots)] > 0).all()


def test_record_plan_and_place(make_checkpoint, tmp_path):
    """`--record-expert-load` writes a workload's loads; `moeserve eplb plan` turns them into a
    placement; `--expert-placement` serves with it and gives the same greedy tokens."""
    import json

    from moeserve import LLM, SamplingParams
    from moeserve.cli import main

    folder = make_checkpoint("qwen3_moe", 7, num_experts=8, num_experts_per_tok=3)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11, 7)]
    record, placement = tmp_path / "loads.json", tmp_path / "placement.json"
    with LLM(str(folder), max_model_len=64, num_redundant_experts=2, record_expert_load=str(record)) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    recorded = json.loads(record.read_text())
    pairs = (3 + 11 + 7 + 3 * 5) * 3  # every prompt token and every decoded token but the last, k = 3
    assert [sum(layer) for layer in recorded["loads"]] == [pairs, pairs]
    argv = [
        "eplb",
        "plan",
        "--loads",
        str(record),
        "--ep",
        "1",
        "--num-redundant-experts",
        "4",
        "--out",
        str(placement),
    ]
    assert main(argv) == 0
    planned = ExpertMap.load(placement)
    assert planned.num_physical == 12
    hottest = max(range(8), key=lambda e: recorded["loads"][0][e])
    assert len(planned.replicas(0)[hottest]) > 1
    options = dict(max_model_len=64, num_redundant_experts=4, expert_placement=str(placement))
    with LLM(str(folder), **options) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)] == expected


def test_hash_routed_layers_count_their_load_and_reach_replicas(make_checkpoint, one_thread):
    """DeepSeek-V4's `hash_moe` layers, whose experts `tid2eid[token]` fixes, in 12 shuffled slots
    (four experts replicated) as the learned layers after them: the load EPLB reads at the
    router (`logical_load`) and the rows `--record-expert-load` reads per slot, mapped back to
    logical experts, are both the histogram of `tid2eid[tokens]`; a hash-chosen expert's rows are
    spread over its replicas; every block returns the plain model's output (to rounding: V4's
    clamped experts do not round alike on every split of their rows, learned layers' neither)."""
    folder = make_checkpoint("deepseek_v4")
    layer = (5, 0, 7, 2, 5, 1, 6, 3, 4, 0, 7, 5)
    plain = load_model(folder)
    num_layers = len(plain.moe_blocks())
    expert_map = ExpertMap((layer, tuple(reversed(layer))) * (num_layers // 2), 8, 1)
    shuffled = load_model(
        folder, dispatcher=create_dispatcher("local", expert_map.slot_placement()), expert_map=expert_map
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, plain.cfg.hidden_size, generator=g)
    token_ids = torch.randint(0, plain.cfg.vocab_size, (37,), generator=g)
    hashed = [i for i, block in enumerate(shuffled.moe_blocks()) if isinstance(block.router, HashRouter)]
    assert hashed == [0, 1]
    for block in shuffled.moe_blocks():
        block.track_logical_load()
    for ours, theirs in zip(shuffled.moe_blocks(), plain.moe_blocks()):
        torch.testing.assert_close(ours(x, None, token_ids), theirs(x, None, token_ids), rtol=1e-6, atol=1e-6)
    counted = logical_rows(shuffled.take_routed_tokens(), expert_map, 0)
    for i in hashed:
        block = shuffled.moe_blocks()[i]
        histogram = torch.bincount(block.router.tid2eid[token_ids].flatten(), minlength=8)
        assert block.logical_load.tolist() == counted[i] == histogram.tolist()
        served = block.routed_tokens  # reset by the read: count again on a second pass
        assert not served.any()
        block(x, None, token_ids)
        for e, slots in enumerate(expert_map.replicas(i)):
            assert served[list(slots)].sum() == histogram[e]
            if histogram[e] >= len(slots):
                assert (served[list(slots)] > 0).all()
