"""No host sync inside the MoE layers of an ep = 4 decode step (`torch` dispatcher, gloo).

Each rank loads its share of a real checkpoint, runs a prefill step without a step bound (the
uneven all-to-all: its one declared host read per MoE layer shows up inside the MoE layers, which
proves the counter sees them there) and then a decode step with the step-global bound, which
must make none. The ep = 1 half is tests/unit/test_host_syncs.py.
"""

from __future__ import annotations

import pytest
from helpers.host_syncs import UPLOADS
from host_sync_cases import run_rank
from ranks import run_ranks

EP = 4


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_decode_step_has_no_host_sync_in_moe_layers(make_checkpoint, arch):
    folder = make_checkpoint(arch, 3, **({"num_experts": 8} if arch == "qwen3_moe" else {}))
    decode_bound = EP  # rank r decodes r + 1 sequences: at most EP tokens on any rank
    results = run_ranks(EP, run_rank, str(folder), decode_bound)
    for rank, got in enumerate(results):
        assert got["syncs_host"] == {"prefill": True, "decode": False}, rank
        assert got["decode"]["inside_moe"] == [], f"rank {rank}: {got['decode']['inside_moe']}"
        # the counter counts: the uneven prefill's host read (one per MoE layer), the runner's uploads
        prefill_reads = [c for c in got["prefill"]["inside_moe"] if c.startswith("Tensor.tolist")]
        assert len(prefill_reads) == got["num_moe_layers"], rank
        assert any(c.startswith(UPLOADS) for c in got["decode"]["outside_moe"]), rank
