"""Every expert/tensor-parallel layout generates the same greedy tokens as one process.

Each (ep, tp) layout runs the real multi-process engine: `ep` rank processes over gloo, the
`torch` all-to-all dispatcher, `ep / tp` data-parallel attention groups of `tp` tensor-parallel
ranks. The prompts are many and uneven, so the groups get different batches, some ranks get no
tokens in some MoE layers, and some steps leave a whole group idle while others decode.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams

LAYOUTS = [(2, 1), (4, 1), (4, 2), (8, 1), (8, 2)]
# Every architecture with 8 routed experts, so 8 ranks hold one each.
ARCH_OVERRIDES = {
    "mixtral": dict(num_local_experts=8),
    "qwen2_moe": dict(num_experts=8),
    "qwen3_moe": dict(num_experts=8),
    "deepseek_v2": dict(),
    "deepseek_v3": dict(),
    "olmoe": dict(num_experts=8),
    "glm4_moe": dict(),
    "minimax_m2": dict(num_local_experts=8),
    "gpt_oss": dict(num_local_experts=8),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=96)


def prompts(n: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    lengths = [1, 3, 17, 5, 30, 9, 2][:n]
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in lengths]


@pytest.fixture(scope="module")
def reference(make_checkpoint):
    """arch -> (checkpoint, tokens from one process)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            folder = make_checkpoint(arch, 5, **ARCH_OVERRIDES[arch])
            outputs = LLM(str(folder), **ENGINE).generate(prompts(), GREEDY, use_tqdm=False)
            cache[arch] = (folder, [o.outputs[0].token_ids for o in outputs])
        return cache[arch]

    return get


# Every layout meets a GQA and an MLA model, and every architecture meets tp=1 and tp=2 and a
# multi-node-sized group of 8 ranks once (each launch costs seconds, so not every pair runs:
# the parallel code paths are shared, and what differs between architectures is their layers).
# The newer families take one layout each, ep=4 with tp=2 (OLMoE's and MiniMax-M2's
# whole-projection q/k norm then sums its squares over the tensor-parallel pair, gpt-oss's
# sinks are split by head, its fused expert tensors read by expert).
ARCH_LAYOUTS = [
    ("mixtral", 4, 1),
    ("mixtral", 8, 2),
    ("qwen2_moe", 2, 1),
    ("qwen2_moe", 4, 2),
    ("qwen2_moe", 8, 1),
    ("qwen3_moe", 2, 1),
    ("qwen3_moe", 8, 2),
    ("deepseek_v2", 2, 1),
    ("deepseek_v2", 8, 2),
    ("deepseek_v3", 4, 1),
    ("deepseek_v3", 4, 2),
    ("deepseek_v3", 8, 1),
] + [(arch, 4, 2) for arch in ("glm4_moe", "gpt_oss", "minimax_m2", "olmoe")]
MLA = {"deepseek_v2", "deepseek_v3"}
for layout in LAYOUTS:  # the design above, kept true as cases change
    archs = {arch for arch, *at in ARCH_LAYOUTS if tuple(at) == layout}
    assert archs & MLA and archs - MLA, layout


@pytest.mark.parametrize("arch,ep,tp", ARCH_LAYOUTS, ids=[f"{a}-ep{e}-tp{t}" for a, e, t in ARCH_LAYOUTS])
def test_layout_matches_single_process(reference, arch, ep, tp):
    folder, expected = reference(arch)
    with LLM(str(folder), ep=ep, tp=tp, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("ep,tp,num_prompts", [(2, 1, 1), (2, 2, 7)], ids=["ep2-tp1", "ep2-tp2"])
def test_unseeded_sampling_matches_single_process(reference, ep, tp, num_prompts):
    """Requests without a seed draw from the sampling rank's global generator, which every rank
    seeds from the engine's seed as the in-process runner does. With one data-parallel group the
    sampling rank sees ep=1's batches, so it draws the same numbers; with several, each group
    samples its own share, so only a lone request can match."""
    folder, _ = reference("qwen3_moe")
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batch = prompts(num_prompts)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **ENGINE).generate(batch, unseeded, use_tqdm=False)]
    with LLM(str(folder), ep=ep, tp=tp, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(batch, unseeded, use_tqdm=False)]
    assert got == expected
    with LLM(str(folder), seed=1, **ENGINE) as other:  # the engine's seed does decide
        assert [o.outputs[0].token_ids for o in other.generate(batch, unseeded, use_tqdm=False)] != expected


def test_generate_command_with_ep(reference, tmp_path):
    """`moeserve generate --ep 2 --tp 2`, as a user runs it: the single process's tokens, and
    no rank process outlives the command."""
    import json
    import subprocess
    import sys

    folder, _ = reference("qwen3_moe")
    prompt = prompts()[2]["prompt_token_ids"]
    expected = (
        LLM(str(folder), **ENGINE)
        .generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    command = [
        sys.executable,
        "-m",
        "moeserve",
        "generate",
        "--model",
        str(folder),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        str(GREEDY.max_tokens),
        "--ignore-eos",
        "--max-model-len",
        "96",
        "--ep",
        "2",
        "--tp",
        "2",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == expected
    assert "stopped 2 rank process(es)" in done.stderr


# Two-batch overlap: each layout's (arch, ep, tp) covers a feature the interleave must keep
# working: shared experts and a gated one (qwen2_moe), MLA with a dense first layer (deepseek),
# tensor-parallel attention, whose collectives are ordered among the dispatches (tp = 2).
OVERLAP_LAYOUTS = [("qwen2_moe", 1, 1), ("deepseek_v3", 1, 1), ("qwen2_moe", 2, 1), ("deepseek_v3", 4, 1)]
OVERLAP_LAYOUTS += [("mixtral", 4, 2), ("deepseek_v2", 4, 2)]


@pytest.mark.parametrize("arch,ep,tp", OVERLAP_LAYOUTS, ids=[f"{a}-ep{e}-tp{t}" for a, e, t in OVERLAP_LAYOUTS])
def test_two_batch_overlap_matches_single_process(reference, monkeypatch, arch, ep, tp):
    """The single process's greedy tokens, without overlap; at ep = 1 (in this process) the
    steps really run as two micro-batches."""
    from moeserve.models import MoECausalLM

    folder, expected = reference(arch)
    passes = []
    steps = MoECausalLM.forward_steps

    def counted(self, input_ids, *args, **kwargs):
        passes.append(input_ids.shape[0])
        return steps(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(MoECausalLM, "forward_steps", counted)
    with LLM(str(folder), ep=ep, tp=tp, two_batch_overlap=True, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected
    if ep == 1:
        assert len(passes) % 2 == 0 and sum(passes) == sum(len(p["prompt_token_ids"]) for p in prompts()) + 9 * 7
        assert all(passes), "with several sequences neither micro-batch is empty"


def test_two_batch_overlap_with_long_prefills(make_checkpoint):
    """Prefills of more than 128 tokens per rank take the uneven all-to-all, whose steps read the
    counts between two collectives; the other micro-batch stays under the bound (low-latency), so
    the two micro-batches of a step dispatch in different modes."""
    folder = make_checkpoint("qwen3_moe", 5, num_experts=8)
    g = torch.Generator().manual_seed(5)
    batch = [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in (200, 150, 6, 40)]
    engine = dict(ENGINE, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **engine).generate(batch, GREEDY, use_tqdm=False)]
    with LLM(str(folder), ep=2, two_batch_overlap=True, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("arch,overlap", [("deepseek_v3", False), ("qwen2_moe", True)])
def test_nvshmem_backend_matches_single_process(reference, arch, overlap):
    """The `nvshmem` all-to-all (Triton kernels storing into peers' shared-memory buffers, under
    the interpreter on CPU) in the real engine: the single process's greedy tokens at ep=4, on MLA
    and on GQA with two-batch overlap interleaving two micro-batches' dispatch steps."""
    folder, expected = reference(arch)
    with LLM(str(folder), ep=4, a2a_backend="nvshmem", two_batch_overlap=overlap, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected


# Every architecture once across two emulated nodes; the options that change what moves (two-batch
# overlap's interleaved steps, FP8 rows) each on an MLA and a GQA model.
NODES_CASES = [(arch, {}) for arch in ARCH_OVERRIDES] + [
    ("deepseek_v3", {"two_batch_overlap": True}),
    ("qwen3_moe", {"two_batch_overlap": True}),
    ("deepseek_v2", {"dispatch_fp8": True}),
    ("qwen3_moe", {"dispatch_fp8": True}),
]


# `nvlink_domain_size=0`: no load/store peer, every rank puts to every rank and to itself (the GPU
# runbook's network-path test): once on MLA, once on GQA with two-batch overlap.
ALL_PUTS_CASES = [("deepseek_v3", {}), ("qwen3_moe", {"two_batch_overlap": True})]
DOMAIN_CASES = [(arch, options, 2) for arch, options in NODES_CASES] + [(a, o, 0) for a, o in ALL_PUTS_CASES]


@pytest.mark.parametrize(
    "arch,options,domain",
    DOMAIN_CASES,
    ids=[f"{a}-{'-'.join(o) or 'plain'}{'-all_puts' * (d == 0)}" for a, o, d in DOMAIN_CASES],
)
def test_nvshmem_between_two_emulated_nodes_matches_torch(reference, arch, options, domain):
    """`nvlink_domain_size=2` at ep=4: ranks {0, 1} and {2, 3} reach each other by the put variants
    (emulated on CPU: staged rows, data before signal) and their own pair by stores, in one step;
    0: every rank, itself included, by the put variants. The greedy tokens are the `torch`
    backend's (the single process's, where no option changes the tokens; with FP8 rows, ep=4's
    through the torch all-to-all)."""
    folder, expected = reference(arch)
    if options.get("dispatch_fp8"):
        with LLM(str(folder), ep=4, a2a_backend="torch", **ENGINE, **options) as llm:
            expected = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    with LLM(str(folder), ep=4, a2a_backend="nvshmem", nvlink_domain_size=domain, **ENGINE, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected


def test_fp8_dispatch_at_ep2_matches_ep1(reference):
    """`--dispatch-fp8`: the MoE layers dispatch FP8 rows, and ep=1's `local` backend quantises
    alike, so ep=2 (the `torch` all-to-all) gives ep=1's greedy tokens with FP8 on. Cumulative
    logprobs show the option reaches both: FP8 moves them away from the unquantised run's, and
    ep=2's land on ep=1's far closer than that."""
    folder, _ = reference("qwen3_moe")
    scored = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(**options) -> tuple[list[list[int]], list[float]]:
        with LLM(str(folder), **ENGINE, **options) as llm:
            outputs = [o.outputs[0] for o in llm.generate(prompts(), scored, use_tqdm=False)]
        return [o.token_ids for o in outputs], [o.cumulative_logprob for o in outputs]

    _, plain = run()
    tokens, fp8 = run(dispatch_fp8=True)
    ep2_tokens, ep2 = run(ep=2, dispatch_fp8=True)
    assert ep2_tokens == tokens
    fp8_shift = max(abs(a - b) for a, b in zip(fp8, plain))
    ep_shift = max(abs(a - b) for a, b in zip(ep2, fp8))
    assert ep_shift * 100 < fp8_shift, (ep_shift, fp8_shift)
