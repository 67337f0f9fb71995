"""Decode step time on this CPU: DeepSeek Sparse Attention against dense MLA, same weights, side by
side in one process.

    python bench/sparse_attention.py [--contexts 2048 8192] [--index-topk 128] [--rounds 15]

Model: the tests' tiny DeepSeek-V3.2 (`tests/helpers/hf_configs.py`: hidden 64, 3 layers, MLA
with 4 heads, kv_lora_rank 16 and rope 8, 16 indexer heads of 16) written once by transformers,
with `index_topk` set to `--index-topk` and room for the longest context. The dense engine
loads the same folder's weights with `index_topk` above every context: each query then sees
all it may and the backend skips the scoring (`ops.sparse_mla`), which is dense MLA; what
remains of the indexer there is its two small projections and its key write, about 1% of a
layer at this width.

Per context: both engines prefill the same prompt (chunks of 512 tokens), then step in turns,
one decode each, for `--rounds` rounds after two warm-up rounds. Each step is timed in this
process's CPU time with one torch thread, which other work on a shared machine disturbs less
than the wall clock. Reported per context: each side's median step, the ratio of the medians
(sparse / dense) and the spread of the per-round ratios (min, quartiles, max). Writes
bench/results/sparse_attention.json after each context.

The torch backend is what runs on CPU; its sparse path (`ops.sparse_mla.sparse_mla_attention`)
expands the latent of every context token before gathering the chosen ones, so attention's
share that scales with the context does not vanish: the ratio measures that backend, not the
gather-first kernel (`kernels.sparse_mla`), which needs a GPU to be timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # moeserve, and the tests' checkpoint builder

from moeserve import LLM, SamplingParams  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MACHINE = "CPU, 2 cores"
CHUNK = 512


def quartiles(values: list[float]) -> dict[str, float]:
    """min, quartiles and max of `values` (at least two), the spread a ratio is reported with."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": q1, "median": median, "q3": q3, "max": max(values)}


def dense_copy(folder: Path, dest: Path, index_topk: int) -> Path:
    """The checkpoint's weights under a config whose `index_topk` no context reaches."""
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).symlink_to(f)
    (dest / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config | {"index_topk": index_topk}))
    return dest


def engine(folder: Path, max_len: int) -> LLM:
    return LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        kernels="torch",
        max_num_seqs=1,
        max_num_batched_tokens=CHUNK,
        max_model_len=max_len,
    )


def cpu_step_s(llm: LLM) -> float:
    started = time.process_time()
    llm.engine.step()
    return time.process_time() - started


def measure(sparse: LLM, dense: LLM, context: int, rounds: int) -> dict:
    """Both engines prefill one `context`-token prompt, then decode in turns."""
    prompt = torch.randint(3, 320, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    params = SamplingParams(max_tokens=rounds + 4, temperature=0.0, ignore_eos=True)
    for llm in (sparse, dense):
        llm.engine.add_requests([({"prompt_token_ids": prompt}, params)])
        for _ in range(-(-context // CHUNK)):  # the prompt in chunks; the last one samples the first token
            llm.engine.step()
    times: dict[str, list[float]] = {"sparse": [], "dense": []}
    for _ in range(rounds + 2):
        for name, llm in (("sparse", sparse), ("dense", dense)):
            times[name].append(cpu_step_s(llm))
    for llm in (sparse, dense):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    sparse_s, dense_s = times["sparse"][2:], times["dense"][2:]
    return {
        "context": context,
        "sparse_step_ms": statistics.median(sparse_s) * 1e3,
        "dense_step_ms": statistics.median(dense_s) * 1e3,
        "ratio": statistics.median(sparse_s) / statistics.median(dense_s),
        "ratio_spread": quartiles([s / d for s, d in zip(sparse_s, dense_s)]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--index-topk", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse_attention.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from helpers.hf_configs import VOCAB, write_checkpoint

    from moeserve.checkpoints import train_tokenizer

    max_len = max(args.contexts) + args.rounds + 16
    record = {
        "bench": "sparse_attention",
        "machine": MACHINE,
        "gpu": None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": 1,
        "model": "tests' tiny deepseek_v32 (hidden 64, 3 layers, 4 MLA heads, 16 indexer heads of 16), float32",
        "index_topk": args.index_topk,
        "rounds": args.rounds,
        "prefill_chunk": CHUNK,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer"
        train_tokenizer(VOCAB, tokenizer)
        folder = write_checkpoint(
            Path(tmp) / "sparse", tokenizer, "deepseek_v32", index_topk=args.index_topk, max_position_embeddings=max_len
        )
        sparse, dense = engine(folder, max_len), engine(dense_copy(folder, Path(tmp) / "dense", max_len), max_len)
        try:
            for context in args.contexts:
                row = measure(sparse, dense, context, args.rounds)
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                args.out.write_text(json.dumps(record, indent=2) + "\n")
        finally:
            sparse.shutdown()
            dense.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
