"""What speculative decoding did in a step: drafts proposed, and which of them the target kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters of one step (or of several, added up)."""

    num_drafts: int = 0
    """Sequences that fed drafts (each such sequence-step is one draft, as vLLM counts them)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[i]: drafts kept at position i (0: the first draft after the last real token)."""

    @classmethod
    def of_step(cls, num_draft_tokens: Mapping[str, int], accepted: Mapping[str, int]) -> SpecDecodeStats:
        """From each drafting sequence's draft count and how many of its drafts were kept
        (a sequence aborted while the step ran is absent from `accepted`, and counts none)."""
        stats = cls()
        for request_id, num in num_draft_tokens.items():
            stats.add(num, accepted.get(request_id, 0))
        return stats

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add another step's counters to these (a run's totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        mine, theirs = self.accepted_per_position, other.accepted_per_position
        mine += [0] * (len(theirs) - len(mine))
        for position, count in enumerate(theirs):
            mine[position] += count

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting sequence gained per step: its kept drafts plus the sampled token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_list(self) -> list[object]:
        return [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)]

    @classmethod
    def from_list(cls, entry: Sequence[object]) -> SpecDecodeStats:
        drafts, draft_tokens, accepted, per_position = entry
        return cls(drafts, draft_tokens, accepted, list(per_position))  # type: ignore[arg-type]
