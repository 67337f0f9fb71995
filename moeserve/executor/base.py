"""Where the model runs for the engine: in this process, or in worker processes (EP/TP).

The engine owns requests, scheduling and detokenization and never touches weights; an
`Executor` turns each step's plan (one per data-parallel group) into sampled tokens. Backends:
`InProcessExecutor` (`in_process.py`: ep = tp = 1, the model in the engine's thread) and
`MultiprocessExecutor` (`multiproc.py`: one process per rank, all in lockstep). The plan is all
an executor needs: it carries what the runners must learn of requests (see `SchedulerOutput`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.executor.healing import HealReport, RanksLostError, RejoinReport
from moeserve.kv_transfer.agent import KvRegistration
from moeserve.kv_transfer.rank_writer import KvWriter
from moeserve.scheduler import StepPlan
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken
from moeserve.worker.sampling_metadata import PendingBitmask


class Executor(ABC):
    """Runs every step's plans; `num_groups` plans per step, each group with `num_kv_blocks`."""

    num_groups: int
    num_kv_blocks: int

    @abstractmethod
    def execute(
        self, plan: StepPlan, token_bitmask: PendingBitmask | None = None, *, profile: bool = False
    ) -> dict[str, SampledToken]:
        """Run one lockstep step; a token for every scheduled request whose plan says `sample`,
        within `token_bitmask`'s allowed tokens for the requests it covers (structured outputs).
        The mask may still be filling: it is waited for only when the logits are ready.

        `profile`: a step of the start-up profile (`engine.step_profile`). It runs as a served
        step does, but its routing is not traffic: no expert-load report, `--record-expert-load`
        file or EPLB window counts it, nor does it count as an EPLB step (the rebalances come
        every `eplb_interval_steps` served steps, however long the profile ran)."""

    @abstractmethod
    def take_routed_tokens(self) -> RoutedTokens | None:
        """Expert load since the previous call, or None if nothing new is known yet."""

    def ask_routed_tokens(self) -> None:  # noqa: B027 - a no-op is right where counters are local
        """Have the next step report the expert load, so that a `take_routed_tokens` after it
        covers every step run so far. Rank processes report only when asked (their counts cross
        a socket); an executor that reads its counters when taken has nothing to do."""

    @abstractmethod
    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """Prompt logprobs computed by the steps since the previous call, per request that asked."""

    def take_rebalances(self) -> list[RebalanceReport]:
        """Live expert rebalances since the previous call, oldest first (none without EPLB)."""
        return []

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:  # noqa: B027 - a no-op is right here
        """`listener(reason)` is called once if the executor can no longer run steps (a rank
        process was lost). The in-process executor has no such failure."""

    def heal(self, lost: RanksLostError) -> HealReport:
        """Go on without the ranks `execute` raised `lost` for; only an executor that raises
        `RanksLostError` heals. Raises (and the engine stops) when it cannot."""
        raise lost

    def rejoin(self) -> RejoinReport | None:
        """Between two steps: take back ranks that were lost and have returned, or None if there
        are none (only an executor that heals restarts ranks). The engine then plans with
        `num_groups` groups again."""
        return None

    def kv_registrations(self) -> list[KvRegistration]:
        """Each data-parallel group's KV cache as registered for transfers (`--kv-transfer`)."""
        raise ValueError(f"{type(self).__name__} cannot transfer KV blocks")

    def kv_writers(self) -> list[KvWriter]:
        """What writes each data-parallel group's blocks into a decode instance's cache (`--role prefill`)."""
        raise ValueError(f"{type(self).__name__} cannot transfer KV blocks")

    def shutdown(self) -> None:  # noqa: B027 - an executor that started nothing has nothing to stop
        """Stop what the executor started; idempotent."""
