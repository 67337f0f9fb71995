"""One grammar-compiling worker process: specs in, serialized compiled grammars out.

Started by `compile_pool` (forked from a forkserver that imported this module) on the
frontend's CPUs, never the engine core's. It loads the served tokenizer once, then answers one
job at a time on its pipe:
`(job_id, StructuredOutputs)` -> `(job_id, True, serialized grammar)` or `(job_id, False, reason)`
(the whole constraint travels, a reasoning model's thinking markers included). A
compile cannot be interrupted inside xgrammar, so the pool ends an overdue or abandoned one by
killing this process and starting another.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import xgrammar as xgr

from moeserve.structured.grammar import build_grammar

NICENESS = 10  # on the frontend's CPUs, HTTP and detokenizing come first: a compile waits for them


def serve(
    conn: Connection,
    load_tokenizer: Callable[[str], object],
    tokenizer_folder: str,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    cpus: Sequence[int],
) -> None:
    """The worker's main: compile until the pipe closes (the pool is gone or shutting down).
    `load_tokenizer` is the server's own loader, handed in (spawn pickles it by name) so that
    this package needs nothing from the engine's."""
    if cpus:
        os.sched_setaffinity(0, cpus)  # before xgrammar starts a thread: they inherit it
    os.nice(NICENESS)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = load_tokenizer(tokenizer_folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    # One thread: the pool's parallelism is its processes, each bounded by the timeout.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(None)  # ready
    while True:
        try:
            job_id, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            grammar = build_grammar(spec)
            conn.send((job_id, True, compiler.compile_grammar(grammar).serialize_json()))
        except ValueError as exc:
            conn.send((job_id, False, str(exc)))
