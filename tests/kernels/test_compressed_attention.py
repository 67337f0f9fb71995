"""DeepSeek-V4's attention kernels (`kernels.compressed_attention`, through `TritonOps`) against
the torch reference (`TorchOps`, i.e. `ops.compressed_attention`), fp32 under the interpreter (one case in fp16).

Spans of one sequence over caches scattered in larger pools (block size 4, a window of 6 keys, so
the window straddles blocks): a prompt from position 0 (its first queries see no closed entry;
CSA ones see fewer entries than the top-k), a prompt of 6 tokens (fewer entries in all than the
top-k), a chunk mid-sequence and a decode. Window-only, HCA (16 tokens per entry, all visible)
and CSA (4 per entry, the indexer's top 3) layers. Then the tiny V4 checkpoint's greedy tokens
with its attention on the kernels.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.cache_spec import PagedSpec
from moeserve.models.loader import load_model
from moeserve.models.v4.cache import SequenceView, V4Batch, allocate, layer_specs
from moeserve.ops import TORCH_OPS, TorchOps
from moeserve.ops.compressed_attention import PagedRows, SequenceKeys
from moeserve.ops.triton_ops import TritonOps

SPANS = [(0, 20), (0, 6), (37, 6), (70, 1)]  # (start, query length)
HEADS, HEAD_DIM, WINDOW, BLOCK_SIZE = 4, 24, 6, 4
INDEX_HEADS, INDEX_DIM, TOP_K = 8, 16, 3
END = max(start + n for start, n in SPANS)


def paged(gen: torch.Generator, rows: int, dim: int) -> PagedRows:
    """`rows` random rows of width `dim` in blocks scattered over a pool with spare blocks."""
    blocks = -(-rows // BLOCK_SIZE)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks]
    return PagedRows(torch.randn(blocks + 3, BLOCK_SIZE, dim, generator=gen), table, BLOCK_SIZE)


@pytest.fixture(scope="module")
def triton_ops() -> TritonOps:
    return TritonOps()


@pytest.fixture(scope="module")
def layer():
    gen = torch.Generator().manual_seed(44)
    return dict(
        window=paged(gen, END, HEAD_DIM),
        hca=paged(gen, END // 16, HEAD_DIM),
        csa=paged(gen, END // 4, HEAD_DIM),
        index_keys=paged(gen, END // 4, INDEX_DIM),
        q=torch.randn(END, HEADS, HEAD_DIM, generator=gen),
        index_q=torch.randn(END, INDEX_HEADS, INDEX_DIM, generator=gen),
        weights=torch.randn(END, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5,
        sinks=torch.randn(HEADS, generator=gen),
    )


def as_mask(chosen: torch.Tensor, num_entries: int) -> torch.Tensor:
    """The kernels' choice `[S, K]` (-1: none) as the reference's bool `[S, E]`."""
    mask = torch.zeros(chosen.shape[0], num_entries + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(chosen < 0, num_entries, chosen).long(), True)
    return mask[:, :num_entries]


def attend(ops, layer, start: int, n: int, kind: str, selection=None) -> torch.Tensor:
    entries, ratio = {"window": (None, 0), "hca": (layer["hca"], 16), "csa": (layer["csa"], 4)}[kind]
    keys = SequenceKeys(start, layer["window"], WINDOW, entries, ratio)
    return ops.compressed_attention(layer["q"][start : start + n], layer["sinks"], HEAD_DIM**-0.5, keys, selection)


@pytest.mark.parametrize("start,n", SPANS)
def test_window_and_hca_attention_match_the_reference(triton_ops, layer, start, n):
    for kind in ("window", "hca"):
        want = attend(TORCH_OPS, layer, start, n, kind)
        got = attend(triton_ops, layer, start, n, kind)
        assert (got - want).abs().max().item() < 1e-5, kind
    if start + n >= 32:  # queries past the first closed entries: they change the output
        window_only = attend(TORCH_OPS, layer, start, n, "window")
        assert (attend(TORCH_OPS, layer, start, n, "hca") - window_only).abs().max().item() > 1e-2


@pytest.mark.parametrize("start,n", SPANS)
def test_csa_indexer_choice_and_attention_match_the_reference(triton_ops, layer, start, n):
    rows = slice(start, start + n)
    select = (layer["index_q"][rows], layer["weights"][rows], layer["index_keys"], start, 4, TOP_K)
    want = TORCH_OPS.compressed_select(*select)
    got = triton_ops.compressed_select(*select)
    num_entries = (start + n) // 4
    assert got.shape == (n, min(TOP_K, num_entries))
    assert torch.equal(as_mask(got, num_entries), want)
    seen = want.sum(-1)
    assert (seen < TOP_K).any() == (start < 12)  # early queries see fewer entries than the top-k
    out = attend(triton_ops, layer, start, n, "csa", got)
    assert (out - attend(TORCH_OPS, layer, start, n, "csa", want)).abs().max().item() < 1e-5
    if seen.max() < num_entries:  # some entry was left out: the choice changes the output
        assert (out - attend(TORCH_OPS, layer, start, n, "csa")).abs().max().item() > 1e-2


def with_dtype(layer, dtype: torch.dtype):
    """The layer with its queries and its window and HCA caches in `dtype`."""
    paged = {name: PagedRows(layer[name].cache.to(dtype), layer[name].table, BLOCK_SIZE) for name in ("window", "hca")}
    return dict(layer, q=layer["q"].to(dtype), **paged)


def test_half_precision_stays_within_its_rounding(triton_ops, layer):
    """fp16 queries and caches: the kernel (fp32 scores and sums, probabilities rounded to fp16
    for the product) against the fp32 reference on the same fp16 values."""
    half = with_dtype(layer, torch.float16)
    got = attend(triton_ops, half, 37, 6, "hca")
    assert got.dtype == torch.float16
    error = (got.float() - attend(TORCH_OPS, with_dtype(half, torch.float32), 37, 6, "hca")).abs().max().item()
    assert error < 1e-3  # fp16's rounding of outputs near 1


def test_sinks_take_their_share(triton_ops, layer):
    """A sink far above every logit leaves almost nothing to the keys; far below, nothing."""
    loud = dict(layer, sinks=torch.full((HEADS,), 60.0))
    assert attend(triton_ops, loud, 37, 6, "hca").abs().max().item() < 1e-6
    quiet = dict(layer, sinks=torch.full((HEADS,), -60.0))
    assert (attend(triton_ops, quiet, 37, 6, "hca") - attend(TORCH_OPS, quiet, 37, 6, "hca")).abs().max().item() < 1e-5


class TritonAttentionOps(TorchOps):
    """The torch backend but for DeepSeek-V4's attention and indexer choice, run on the kernels:
    the rest of V4 (its sqrtsoftplus router, its clamped experts) has no kernel yet, so
    `--kernels triton` refuses the model."""

    compressed_select = TritonOps.compressed_select
    compressed_attention = TritonOps.compressed_attention


def greedy_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The prompt prefilled in chunks of 16, then `new_tokens` greedy decodes, over caches of
    scattered blocks (one slot, one table per group)."""
    specs = [layer_specs(model.cfg, i, torch.float32) for i in range(model.cfg.num_layers)]
    groups = {s.group_key for layer in specs for s in layer if isinstance(s, PagedSpec)}
    tables = {key: torch.randperm(32, generator=torch.Generator().manual_seed(7)) for key in groups}
    caches = [allocate(layer, dict.fromkeys(groups, 32), BLOCK_SIZE, 1) for layer in specs]
    tokens, start, out = list(prompt), 0, []
    while len(out) < new_tokens:
        chunk = tokens[start : start + 16]
        batch = V4Batch((len(chunk),), (SequenceView(start, tables, 0, BLOCK_SIZE),))
        with torch.no_grad():
            hidden = model(torch.tensor(chunk), batch, caches)
        start += len(chunk)
        if start == len(tokens):
            out.append(int(model.compute_logits(hidden[-1:]).argmax()))
            tokens.append(out[-1])
    return out


def test_v4_greedy_tokens_with_the_attention_kernels(make_checkpoint):
    """The tiny V4 checkpoint (a window of 8, CSA layers keeping 3 of up to 6 entries, an HCA
    layer; hash and learned MoE): a 24-token prompt then 3 tokens, its attention on the kernels,
    gives the torch path's tokens. (The interpreter is slow: the engine-level runs of the parity
    tests stay on torch.)"""
    folder = make_checkpoint("deepseek_v4")
    prompt = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(44)).tolist()
    want = greedy_tokens(load_model(folder, ops=TORCH_OPS), prompt, 3)
    assert greedy_tokens(load_model(folder, ops=TritonAttentionOps()), prompt, 3) == want
