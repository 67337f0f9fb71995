"""Grammars in the engine core: compiled once per spec, one matcher per constrained sequence.

The matchers live where the scheduler does (the engine core, as in vLLM v1), because that is
where every sampled token arrives first, whatever the parallel layout: each step the core fills
one bitmask for the constrained sequences that sample, in one batched call (xgrammar's C++
threads, the GIL released) on a thread of its own that runs beside the step's forward, and
ships it after the plan; the sampling process (the in-process runner, or each group's sampling
rank) waits for it only when its logits are ready, masks its rows with it and never needs
xgrammar. When the tokens come back the matchers advance.

Behind the server, grammars arrive compiled (`compile_pool`: worker processes on the frontend's
CPUs, where a slow compile costs the step loop nothing) and are only loaded here. Offline, they
are compiled here, on a worker thread: a sequence whose grammar is not ready yet is held back
by the core, not the scheduler, and the step loop never waits for a compile while it has other
work.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from moeserve.engine_config import StructuredOutputsConfig
from moeserve.sampling_params import StructuredOutputs
from moeserve.structured.grammar import build_grammar
from moeserve.structured.lru import ByteLRU
from moeserve.worker.sampling_metadata import PendingBitmask, TokenBitmask

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiled grammars by spec, in an LRU bounded in bytes; identical specs share one.

    A spec that arrives compiled (the server compiled it in a worker process) is only loaded, on
    the caller's thread: its size was bounded where it was compiled. One that does not (offline
    use, where the caller is the only client) is compiled on one worker thread. The tokenizer's
    xgrammar view is built on first use, so a server that never sees structured outputs never
    builds it.
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_bytes: int = StructuredOutputsConfig.cache_bytes,
        max_threads: int = 2,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._max_threads = max_threads
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-grammar")
        self._compiling: dict[StructuredOutputs, Future[xgr.CompiledGrammar]] = {}
        self._compiled = ByteLRU(cache_bytes)  # of done futures, so a spec asked twice gets the same one
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, or the compile in progress (ValueError if it fails)."""
        with self._lock:
            future = self._compiled.get(spec) or self._compiling.get(spec)
            if future is not None:
                return future  # type: ignore[return-value]
            if spec.compiled is None:
                future = self._pool.submit(self._compile, spec)
                self._compiling[spec] = future
                future.add_done_callback(lambda f: self._keep(spec, f))
                return future
        future = Future()
        future.set_result(xgr.CompiledGrammar.deserialize_json(spec.compiled, self._tokenizer_info()))
        self._keep(spec, future)
        return future

    def _keep(self, spec: StructuredOutputs, future: Future[xgr.CompiledGrammar]) -> None:
        """Into the LRU, at its compiled size, once compiled."""
        with self._lock:
            self._compiling.pop(spec, None)
            if not future.cancelled() and future.exception() is None:
                self._compiled.put(spec, future, future.result().memory_size_bytes)

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._info is None:
                tokenizer = self._load_tokenizer()
                self._info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
            return self._info

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=self._max_threads)
        return self._compiler.compile_grammar(build_grammar(spec))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputManager:
    """Matchers of the constrained sequences, by sequence id."""

    def __init__(self, compiler: GrammarCompiler, max_threads: int = 2) -> None:
        self.compiler = compiler
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="moeserve-bitmask")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start(self, request_id: str, compiled: xgr.CompiledGrammar) -> None:
        """A fresh matcher for a sequence about to be scheduled."""
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def start_bitmask(
        self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]] | None = None
    ) -> PendingBitmask | None:
        """Start filling the allowed next tokens of those of `request_ids` under a grammar (one
        batched fill, on the filler thread); None when none is. The matchers must not change
        until the mask is taken: the core advances them only after the step has sampled.

        `drafts`: the n-gram drafts a sequence verifies this step. Such a sequence gets a row
        after each of its drafts too, the grammar walked over them and rolled back after, so
        each draft is judged by the mask the grammar would give at its position had the drafts
        before it been sampled."""
        ids = tuple(r for r in request_ids if r in self._matchers)
        if not ids:
            return None
        walks = {r: list(drafts[r]) for r in ids if drafts and drafts.get(r)}
        return PendingBitmask(self._filler.submit(self._fill, ids, walks).result)

    def _fill(self, request_ids: tuple[str, ...], walks: dict[str, list[int]]) -> TokenBitmask:
        num_rows = [len(walks.get(r, ())) + 1 for r in request_ids]
        firsts = list(itertools.accumulate(num_rows, initial=0))[:-1]
        matchers = [self._matchers[r] for r in request_ids]
        bitmask = xgr.allocate_token_bitmask(sum(num_rows), self.compiler.vocab_size)  # [rows, W] int32
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, firsts)
        for request_id, matcher, first in zip(request_ids, matchers, firsts):
            if request_id in walks:
                _fill_after_drafts(matcher, walks[request_id], bitmask, first)
        return TokenBitmask(request_ids, bitmask, tuple(num_rows) if walks else ())

    def accept(self, added: Mapping[str, Sequence[int]], request_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Advance the matchers of `request_ids` by the tokens their step added (accepted drafts,
        then the sampled one): (sequences whose grammar is now complete and ended, sequences
        whose token the grammar refused)."""
        terminated, refused = [], []
        for request_id in request_ids:
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            for token in added.get(request_id, ()):
                if not matcher.accept_token(token):
                    logger.error("the grammar of %s refused its sampled token %d", request_id, token)
                    refused.append(request_id)
                    break
                if matcher.is_terminated():
                    terminated.append(request_id)
                    break
        return terminated, refused

    def shutdown(self) -> None:
        self._filler.shutdown(wait=True)
        self.compiler.shutdown()


def _fill_after_drafts(matcher: xgr.GrammarMatcher, drafts: Sequence[int], bitmask, first: int) -> None:
    """Rows first + 1 .. first + len(drafts) of `bitmask`: the allowed tokens after each draft,
    the matcher's row 0 already filled. From the first draft the grammar refuses on, the rows
    repeat the last mask: that draft fails verification (the mask forbids it), so the rows after
    it judge nothing, but each must still allow some token. After a draft that completes the
    grammar (its stop token) the same: the sequence ends there (the scheduler stops at EOS;
    `can_draft` keeps ignore_eos sequences under a grammar from drafting)."""
    walked = 0
    for i, token in enumerate(drafts, start=1):
        if walked == i - 1 and not matcher.is_terminated() and matcher.accept_token(token):
            walked = i
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, first + i)
                continue
        bitmask[first + i] = bitmask[first + i - 1]
    if walked:
        matcher.rollback(walked)
