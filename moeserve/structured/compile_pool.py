"""Grammar compiles in worker processes, bounded in time, per client and in memory.

A compile is CPU work that grows with the spec (seconds for a big enum) and cannot be
interrupted inside xgrammar. Run in the engine core it takes the step loop's CPU and GIL, so
the server compiles here instead: in `compile_workers` processes (`compile_worker.py`) started
from the API process, whose CPUs (the frontend's, under the CPU binding) they inherit. They are
forked from a forkserver that has imported xgrammar (and torch, which it imports) once: a worker
costs a fork instead of seconds of imports, at start-up and each time a kill replaces one. The
engine core only loads the result (`StructuredOutputs.compiled`).

- Time: a compile still running at `compile_timeout_s` is ended by killing its worker (another
  starts), and the spec is refused naming the limit, for this request only: how long a compile
  takes depends on the machine's load at the time, so a timeout is not remembered and the next
  request for the spec compiles it again. Timeouts are counted (`on_timeout`, /metrics'
  `moeserve:structured_outputs_compile_timeouts_total`).
- Clients: each (its API key, else its connection) may wait on `compile_queue_per_client`
  compiles at once (`CompileQueueFullError` beyond) and run on all workers but one, so one
  client's slow specs leave a worker for everyone else; queued jobs are taken round-robin by client.
- Cancellation: each waiter holds its own future; when every waiter of a job has cancelled
  (a client left, a request was aborted), a queued job is dropped and a running one killed.
  Shutdown kills the workers and waits for none of them.
- Memory: results (serialized grammars, and refusals of specs that are invalid, whose compile
  crashed the worker or whose grammar is over `max_compiled_bytes`, so a bad spec sent again
  costs nothing) are kept by spec in an LRU bounded in bytes; identical specs in flight share one
  compile.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from moeserve.distributed.processes import child_context
from moeserve.engine_config import StructuredOutputsConfig
from moeserve.sampling_params import StructuredOutputs
from moeserve.structured.lru import ByteLRU

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often a running compile is looked at for cancellation, timeout and shutdown
RESTART_DELAY_S = 1.0  # after a worker died by itself, so one that cannot start does not spin
WORKER_MODULE = "moeserve.structured.compile_worker"  # imported by the forkserver, not by this process


class CompileRefusedError(ValueError):
    """The spec does not compile: invalid, over the compiled size, or past the compile timeout
    (this time: a timeout is not remembered)."""


class CompileQueueFullError(RuntimeError):
    """The client already waits on as many compiles as it may."""


class CompilePoolClosedError(RuntimeError):
    """The server is shutting down."""


@dataclass(eq=False)
class _Job:
    id: int
    spec: StructuredOutputs
    client: str
    waiters: dict[Future, str] = field(default_factory=dict)
    """Each waiter's own future -> its client."""
    running: bool = False


_Outcome = tuple[bool, str]  # (compiled, serialized grammar or the refusal's message)


@dataclass(frozen=True)
class _Result:
    """How a compile ended: its outcome for the waiters, and whether it ran out of time, which
    says something about the load of the moment rather than the spec (so it is not cached)."""

    outcome: _Outcome
    timed_out: bool = False


class GrammarCompilePool:
    """See the module docstring. Thread-safe; `compile` is its asyncio face."""

    def __init__(
        self,
        config: StructuredOutputsConfig,
        load_tokenizer: Callable[[str], object],
        tokenizer_folder: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cpus: Sequence[int] = (),
        on_timeout: Callable[[], None] = lambda: None,
    ) -> None:
        """load_tokenizer: how a worker loads the served tokenizer from `tokenizer_folder` (a
        module-level function: spawn pickles it by name). cpus: where the workers run; empty:
        wherever this process may. on_timeout: called (on a slot's thread) for each compile
        ended at the timeout."""
        self.config = config
        self._on_timeout = on_timeout
        self._timeouts = 0
        self._worker_args = (load_tokenizer, tokenizer_folder, vocab_size, tuple(eos_token_ids), tuple(cpus))
        self._context = child_context(WORKER_MODULE)
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # by client, visited round-robin
        self._jobs: dict[StructuredOutputs, _Job] = {}  # queued or running
        self._running: Counter[str] = Counter()  # running jobs by the client that asked first
        self._waiting: Counter[str] = Counter()  # futures each client waits on
        self._results = ByteLRU(config.cache_bytes)
        self._ids = itertools.count()
        self._closed = False
        self._slots = [_Slot(self, i) for i in range(config.compile_workers)]
        for slot in self._slots:
            slot.thread.start()

    # ---- callers ----------------------------------------------------------------------------

    def submit(self, spec: StructuredOutputs, client: str) -> Future[str]:
        """A future of `spec`'s serialized grammar (CompileRefusedError if it does not compile);
        cancel it to stop waiting. CompileQueueFullError at once if `client` waits on too many."""
        with self._cond:
            if self._closed:
                raise CompilePoolClosedError("the server is shutting down")
            future: Future[str] = Future()
            known = self._results.get(spec)
            if known is not None:
                _settle(future, known)  # type: ignore[arg-type]
                return future
            if self._waiting[client] >= self.config.compile_queue_per_client:
                raise CompileQueueFullError(
                    f"this client already has {self._waiting[client]} structured-output grammars compiling; "
                    f"the limit is {self.config.compile_queue_per_client} (--structured-outputs-queue-per-client)"
                )
            job = self._jobs.get(spec)
            if job is None:
                job = _Job(next(self._ids), spec, client)
                self._jobs[spec] = job
                self._queues.setdefault(client, deque()).append(job)
                self._cond.notify_all()
            job.waiters[future] = client
            self._waiting[client] += 1
        future.add_done_callback(lambda f: f.cancelled() and self._release(job, f))
        return future

    async def compile(self, spec: StructuredOutputs, client: str) -> str:
        """`submit`, awaited: cancelling the caller cancels its wait (and the compile, if it was
        the last one waiting)."""
        return await asyncio.wrap_future(self.submit(spec, client))

    def stats(self) -> dict[str, int]:
        """Queued and running jobs, live workers, cached results, compiles ended at the timeout:
        what the abuse tests watch."""
        with self._cond:
            return {
                "queued": sum(len(q) for q in self._queues.values()),
                "running": sum(self._running.values()),
                "waiting": sum(self._waiting.values()),
                "workers": sum(slot.alive() for slot in self._slots),
                "cached": len(self._results),
                "cached_bytes": self._results.size,
                "timeouts": self._timeouts,
            }

    def shutdown(self) -> None:
        """Kill every worker now and fail every waiter: shutdown never waits on a compile."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._queues.clear()
            self._cond.notify_all()
        for slot in self._slots:
            slot.kill()
        for job in jobs:
            for waiter in job.waiters:
                _fail(waiter, CompilePoolClosedError("the server is shutting down"))

    # ---- slots ------------------------------------------------------------------------------

    def _next_job(self) -> _Job | None:
        """The next job to run, round-robin by client among those under their share of the
        workers; blocks until there is one. None once the pool is closed."""
        share = max(1, self.config.compile_workers - 1)
        with self._cond:
            while not self._closed:
                for client, queue in self._queues.items():
                    if self._running[client] < share:
                        job = queue.popleft()
                        if not queue:
                            del self._queues[client]
                        else:
                            self._queues.move_to_end(client)
                        job.running = True
                        self._running[job.client] += 1
                        return job
                self._cond.wait()
            return None

    def _abandoned(self, job: _Job) -> bool:
        with self._cond:
            return self._closed or not job.waiters

    def _finish(self, job: _Job, result: _Result | None) -> None:
        """A job is over: `result` for its waiters (and the cache, unless it timed out); None: it
        was abandoned, or its worker died, and it goes back to the queue if someone waits for it
        (again)."""
        outcome = None if result is None else result.outcome
        with self._cond:
            job.running = False
            self._running[job.client] -= 1
            if self._running[job.client] <= 0:
                del self._running[job.client]
            if outcome is None and job.waiters and not self._closed:
                self._queues.setdefault(job.client, deque()).appendleft(job)
                self._cond.notify_all()
                return
            if self._jobs.get(job.spec) is job:
                del self._jobs[job.spec]
            waiters = list(job.waiters)
            for client in job.waiters.values():
                self._uncount(client)
            job.waiters.clear()
            timed_out = result is not None and result.timed_out
            if timed_out:
                self._timeouts += 1
            elif result is not None:
                self._results.put(job.spec, result.outcome, len(result.outcome[1]))
            self._cond.notify_all()
        if timed_out:
            self._on_timeout()
        for waiter in waiters:
            if outcome is None:
                _fail(waiter, CompilePoolClosedError("the server is shutting down"))
            else:
                _settle(waiter, outcome)

    def _release(self, job: _Job, waiter: Future) -> None:
        """A waiter cancelled: the last one out drops a queued job (a running one is killed by
        its slot, which polls `_abandoned`)."""
        with self._cond:
            client = job.waiters.pop(waiter, None)
            if client is None:
                return
            self._uncount(client)
            if job.waiters or job.running:
                return
            self._jobs.pop(job.spec, None)
            queue = self._queues.get(job.client)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.client]

    def _uncount(self, client: str) -> None:
        self._waiting[client] -= 1
        if self._waiting[client] <= 0:
            del self._waiting[client]

    def _start_worker(self) -> tuple[multiprocessing.process.BaseProcess, object]:
        compile_worker = importlib.import_module(WORKER_MODULE)  # the workers' code, not this process's

        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=compile_worker.serve, args=(child, *self._worker_args), name="moeserve-grammar", daemon=True
        )
        process.start()
        child.close()
        return process, parent


class _Slot:
    """One worker process and the thread that feeds it jobs, restarting it when it is killed."""

    def __init__(self, pool: GrammarCompilePool, index: int) -> None:
        self.pool = pool
        self.thread = threading.Thread(target=self._run, name=f"moeserve-grammar-slot-{index}", daemon=True)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._lock = threading.Lock()

    # A forkserver child's exit status is read once, from a pipe: the slot's thread and a thread
    # killing the worker look at it under the lock, so neither reads it from under the other.
    def alive(self) -> bool:
        with self._lock:
            return self._process is not None and self._process.is_alive()

    def kill(self) -> None:
        with self._lock:
            process, self._process = self._process, None
            if process is not None and process.is_alive():
                process.kill()
        if process is not None:
            process.join(1.0)

    def _run(self) -> None:
        pool = self.pool
        while not pool._closed:
            conn = None
            try:
                # Started outside the lock: the first start waits for the forkserver's imports,
                # which a shutdown meanwhile must not wait for.
                process, conn = pool._start_worker()
                with self._lock:
                    self._process = process
                if pool._closed:
                    return  # the finally kills it
                if not self._ready(conn):
                    if pool._closed:
                        return
                    raise RuntimeError(f"it exited while starting ({self._exit_code()})")
                while True:
                    job = pool._next_job()
                    if job is None:
                        return
                    try:
                        result, healthy = self._compile(job, conn)
                    except BaseException:  # the worker died: a spec that crashes it is refused
                        crashed = _Result((False, "the grammar compiler failed on this spec"))
                        pool._finish(job, None if pool._closed else crashed)
                        raise
                    pool._finish(job, result)
                    if not healthy:
                        break
            except Exception as exc:  # noqa: BLE001 - the worker died (killed at shutdown, crashed) or could not start
                if not pool._closed:
                    logger.error("a grammar worker failed (%s: %s); starting another", type(exc).__name__, exc)
                    time.sleep(RESTART_DELAY_S)
            finally:
                self.kill()
                if conn is not None:
                    conn.close()

    def _exit_code(self) -> str:
        with self._lock:
            return "gone" if self._process is None else f"exit code {self._process.exitcode}"

    def _ready(self, conn) -> bool:
        """Wait for a new worker to load the tokenizer; False if it died first."""
        while not conn.poll(POLL_S * 5):
            if self.pool._closed or not self.alive():
                return False
        conn.recv()
        return True

    def _compile(self, job: _Job, conn) -> tuple[_Result | None, bool]:
        """Run `job`: (its result, None if abandoned; whether the worker may be reused)."""
        config = self.pool.config
        conn.send((job.id, job.spec))
        deadline = time.monotonic() + config.compile_timeout_s
        while not conn.poll(POLL_S):
            if self.pool._abandoned(job):
                return None, False
            if time.monotonic() >= deadline:
                logger.warning("a %s grammar compiled for over %s s; killed", job.spec.kind, config.compile_timeout_s)
                message = (
                    f"the grammar did not compile within {config.compile_timeout_s:g} s; the limit is "
                    "--structured-outputs-compile-timeout"
                )
                return _Result((False, message), timed_out=True), False
        _, compiled, text = conn.recv()
        if compiled and len(text) > config.max_compiled_bytes:
            message = (
                f"the compiled grammar has {len(text)} bytes; the limit is {config.max_compiled_bytes} "
                "(--structured-outputs-max-compiled)"
            )
            return _Result((False, message)), True
        return _Result((compiled, text)), True


def _settle(future: Future, outcome: _Outcome) -> None:
    compiled, text = outcome
    if compiled:
        try:
            future.set_result(text)
        except InvalidStateError:  # cancelled meanwhile
            pass
    else:
        _fail(future, CompileRefusedError(text))


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass
