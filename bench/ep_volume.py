"""Bytes on the wire: what EP's all-to-all moves per token and MoE layer, live, next to the formula
(and TP's all-reduce, by formula), for N = 2, 4, 8 ranks over the same model and workload.

For each N the engine runs a fixed workload at ep=N, tp=1 (N data-parallel groups) and at ep=N,
tp=N (one group; each TP rank dispatches its 1/N slice of the tokens). The ranks count, from the
routing, the rows each dispatched to each rank (`dispatch.wire`); every step is reported. Per
token and MoE layer the table gives:

* `ep_live`: rows that crossed ranks, dispatch out plus combine back, from the counters; `local`:
  rows that stayed on their rank (not in `ep_live`), also counted;
* `ep_formula`: 2 K (N - 1) / N, uniform routing (the router is not uniform: live differs);
* `tp_formula`: 2 (N - 1), a ring all-reduce (reduce-scatter + all-gather) of the layer's output
  over the TP group, the volume an MoE layer with TP-sharded experts moves. TP is not measured:
  moeserve shards experts by EP only. EP's volume does not grow with N; TP's does, and passes
  EP's once N > K.

Bytes are rows times the row size (activation dtype; `--dispatch-fp8` halves the dispatch side).
`ep_intra_bytes` / `ep_inter_bytes` split the live bytes (dispatch and combine) between ranks of
one NVLink domain and ranks of different ones, which cross the NIC (`--nvlink-domain-size`, of
ranks; default: all ranks in one domain, a single node).

    python bench/ep_volume.py [--sizes 2 4 8] [--nvlink-domain-size 2] [--out bench/results/ep_volume.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

import moeserve.engine.core as engine_core
from moeserve import LLM, SamplingParams
from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.dispatch.wire import LINKS, ep_rows_per_token, tp_rows_per_token

RESULTS = Path(__file__).parent / "results"
SPEC = MakeModelSpec(arch="qwen3_moe", layers=2, hidden=128, heads=8, experts=16, top_k=4)  # 8 heads: tp=8 runs
PROMPTS = 32
PROMPT_TOKENS = 24
NEW_TOKENS = 8


class Reports:
    """Every step's `RoutedTokens` (the engine is made to report them each step)."""

    def __init__(self) -> None:
        self.routed = []

    def record(self, stats) -> None:
        if stats.routed_tokens is not None:
            self.routed.append(stats.routed_tokens)


def run(folder: Path, ep: int, tp: int, domain: int | None) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = [
        {"prompt_token_ids": torch.randint(3, 500, (PROMPT_TOKENS,), generator=g).tolist()} for _ in range(PROMPTS)
    ]
    reports = Reports()
    domain = None if domain is None else min(domain, ep)
    with LLM(str(folder), ep=ep, tp=tp, max_model_len=64, nvlink_domain_size=domain, stat_loggers=[reports]) as llm:
        llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wires = [r.wire for r in reports.routed if r.wire is not None]
    sent = sum(w.sent(src) for w in wires for src in range(ep))
    local = sum(w.local(src) for w in wires for src in range(ep))
    pairs = sum(sum(map(sum, r.counts)) for r in reports.routed)
    moe_layers = len(reports.routed[0].layers)
    token_layers = pairs / SPEC.top_k  # tokens x MoE layers
    row_bytes = wires[0].dispatch_row_bytes
    link_bytes = {
        link: sum(w.dispatch_bytes(r, link) + w.combine_bytes(r, link) for w in wires for r in range(ep))
        for link in LINKS
    }
    return {
        "ep": ep,
        "tp": tp,
        "tokens": token_layers / moe_layers,
        "rows_dispatched": sent + local,
        "ep_live": 2 * sent / token_layers,
        "local": local / token_layers,
        "ep_formula": ep_rows_per_token(SPEC.top_k, ep),
        "tp_formula": tp_rows_per_token(ep),
        "ep_live_bytes": 2 * sent / token_layers * row_bytes,
        "ep_intra_bytes": link_bytes["intra_domain"] / token_layers,
        "ep_inter_bytes": link_bytes["inter_domain"] / token_layers,
        "tp_formula_bytes": tp_rows_per_token(ep) * row_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--nvlink-domain-size", type=int, default=None, help="ranks per NVLink domain")
    parser.add_argument("--out", type=Path, default=RESULTS / "ep_volume.json")
    args = parser.parse_args()
    engine_core.ROUTING_INTERVAL_S = 0.0  # every step's counters, so none is left unreported
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(SPEC, Path(tmp) / "model")
        for n in args.sizes:
            for tp in (1, n):
                rows.append(run(folder, n, tp, args.nvlink_domain_size))
                r = rows[-1]
                print(
                    f"N={n} tp={tp}: per token and MoE layer, rows crossing ranks {r['ep_live']:.2f} live / "
                    f"{r['ep_formula']:.2f} EP formula (+{r['local']:.2f} stayed local); TP ring all-reduce "
                    f"{r['tp_formula']:.0f} rows; bytes {r['ep_live_bytes']:.0f} EP live vs "
                    f"{r['tp_formula_bytes']:.0f} TP ({r['ep_intra_bytes']:.0f} inside NVLink domains, "
                    f"{r['ep_inter_bytes']:.0f} between them)",
                    flush=True,
                )
    result = {
        "model": {
            "arch": SPEC.arch,
            "hidden": SPEC.hidden,
            "experts": SPEC.experts,
            "top_k": SPEC.top_k,
            "dtype": "float32",
        },
        "workload": {"prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS},
        "machine": platform.platform(),
        "formula": "per token and MoE layer: EP 2K(N-1)/N rows (uniform routing, out and back); "
        "TP 2(N-1) rows (ring all-reduce)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
