"""Where lost ranks' experts go (`eplb.survivors`) and how a survivor fills its new slots."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.load_only import LoadOnly

from moeserve.checkpoints import quantize_fp8, quantize_mxfp4
from moeserve.dispatch import ExpertMap
from moeserve.eplb.recovery import recover_layer
from moeserve.eplb.survivors import SlotSource, recovery_plan, survivor_map
from moeserve.models import load_model
from moeserve.models.loader import ExpertReader


def check_serves_every_expert(new: ExpertMap) -> None:
    for i in range(new.num_layers):
        assert set(new.physical_to_logical[i]) == set(range(new.num_logical))


def test_survivors_keep_their_experts_and_the_lost_ones_go_where_slots_are_free():
    old = ExpertMap.default(6, 0, 4, 2)  # slots 2, 2, 1, 1: rank 2 holds expert 4
    new = survivor_map(old, [0, 1, 3])
    assert new.ep_size == 3 and new.num_physical == 6
    check_serves_every_expert(new)
    assert [new.local_logical(0, r) for r in range(3)] == [(0, 1), (2, 3), (5, 4)]
    plan = recovery_plan(old, new, [0, 1, 3], 0)
    assert [s.kind for s in plan[0] + plan[1]] == ["local"] * 4
    assert plan[2] == [SlotSource(0, 5, "local", 2, 0), SlotSource(1, 4, "checkpoint")]


def test_a_surviving_replica_is_copied_from_its_rank_not_read_from_the_checkpoint():
    old = ExpertMap.default(6, 2, 4, 1)  # 8 slots: ranks hold (0, 1), (2, 3), (4, 5), (0, 1)
    new = survivor_map(old, [1, 2, 3])  # rank 0 lost: 0 and 1 survive on old rank 3 (new rank 2)
    check_serves_every_expert(new)
    assert Counter(new.physical_to_logical[0]) == Counter(old.physical_to_logical[0])  # replica counts kept
    plan = recovery_plan(old, new, [1, 2, 3], 0)
    sources = [s for per_rank in plan for s in per_rank]
    assert not [s for s in sources if s.kind == "checkpoint"]
    assert {(s.expert, s.src) for s in sources if s.kind == "peer"} == {(0, 2), (1, 2)}


def test_two_losses_in_a_row_keep_every_expert_served():
    old = ExpertMap.default(16, 0, 8, 3)
    once = survivor_map(old, [0, 1, 2, 4, 5, 6, 7])
    twice = survivor_map(once, [0, 1, 2, 3, 5, 6])
    check_serves_every_expert(once)
    check_serves_every_expert(twice)
    assert sorted(len(twice.slots_of(r)) for r in range(6)) == [2, 2, 3, 3, 3, 3]


def test_a_returned_rank_takes_back_the_slots_the_others_no_longer_fit():
    old = ExpertMap.default(16, 4, 4, 2)  # 20 slots, 5 a rank; rank 3 holds 15 and replicas of 0-3
    healed = survivor_map(old, [0, 1, 3])
    grown = survivor_map(healed, [0, 1, 2, None])
    check_serves_every_expert(grown)
    assert grown.ep_size == 4 and Counter(grown.physical_to_logical[0]) == Counter(old.physical_to_logical[0])
    for r in range(3):  # each keeps the slots it holds, as far as its share of 5 goes
        assert grown.local_logical(0, r) == healed.local_logical(0, r)[:5]
    plan = recovery_plan(healed, grown, [0, 1, 2, None], 0)
    assert [s.kind for s in plan[0] + plan[1] + plan[2]] == ["local"] * 15
    assert plan[3] and all(s.kind == "peer" for s in plan[3])  # every expert is still held: nothing read


@pytest.mark.parametrize("survivors", [[], [None], [1, 0], [0, 4], [0, 0]])
def test_bad_survivor_lists_are_refused(survivors):
    with pytest.raises(ValueError, match="survivors"):
        survivor_map(ExpertMap.default(6, 0, 4, 1), survivors)


def test_recover_layer_copies_its_own_slots_and_reads_the_rest():
    w13 = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    w2 = -torch.arange(3 * 4 * 1, dtype=torch.float32).reshape(3, 4, 1)
    plan = [[SlotSource(0, 7, "local", 0, 2), SlotSource(1, 9, "checkpoint"), SlotSource(2, 5, "local", 0, 0)]]
    stored = {9: (torch.full((2, 4), 9.0), torch.full((4, 1), 9.0))}

    def read(experts: list[int]) -> list[torch.Tensor]:
        return [torch.stack([stored[e][k] for e in experts]) for k in range(2)]

    (new13, new2), done = recover_layer([w13, w2], plan, 0, read, tag=0)
    assert torch.equal(new13, torch.stack([w13[2], torch.full((2, 4), 9.0), w13[0]]))
    assert torch.equal(new2, torch.stack([w2[2], torch.full((4, 1), 9.0), w2[0]]))
    assert (done.checkpoint_slots, done.peer_slots, done.checkpoint_bytes) == (1, 0, 4 * (8 + 4))


@pytest.fixture(scope="module")
def quantized_checkpoints(make_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """An FP8 qwen3_moe (several (16, 16) scale blocks per expert) and an MXFP4 gpt_oss, 8 experts each."""
    root = tmp_path_factory.mktemp("quantized")
    fp8 = shutil.copytree(make_checkpoint("qwen3_moe", 5, num_experts=8), root / "fp8")
    quantize_fp8.quantize_checkpoint(fp8, (16, 16))
    mxfp4 = shutil.copytree(make_checkpoint("gpt_oss", 5, num_local_experts=8), root / "mxfp4")
    quantize_mxfp4.quantize_checkpoint(mxfp4)
    return {"fp8": fp8, "mxfp4": mxfp4}


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_the_reader_gives_quantized_experts_as_a_load_holds_them(quantized_checkpoints, kind):
    """A heal reads lost experts into a rank's slots: every tensor of the experts module (stored
    bytes, scales, biases) must be byte for byte what loading a rank holding those experts gives."""
    folder = quantized_checkpoints[kind]
    experts = [6, 1, 3, 0]  # out of order, as a survivor's new slots may be
    expert_map = ExpertMap(((6, 1, 3, 0, 2, 4, 5, 7),) * 2, 8, 2)  # rank 0's slots hold 6, 1, 3, 0 in both layers
    fresh = load_model(folder, dispatcher=LoadOnly(expert_map.slot_placement(0)), expert_map=expert_map)
    reader = ExpertReader(folder, torch.float32)
    try:
        for i, block in enumerate(fresh.moe_blocks()):
            assert block.experts.parametrizations, "the experts are held quantized"
            read = reader.read(i, block.experts, experts)
            held = dict(block.experts.named_parameters())
            assert read.keys() == held.keys()
            for name, value in held.items():
                got = read[name]
                assert (got.dtype, got.shape) == (value.dtype, value.shape), name
                assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), name
    finally:
        reader.close()
