"""What a request carries when its KV crosses instances (the body's `kv_transfer_params`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvTransferParams:
    """On a prefill instance (`remote` None): hold the prompt's KV for `transfer_id`. On a decode
    instance: load it from the prefill instance whose side channel is at `remote` (host:port)."""

    transfer_id: str
    remote: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transfer_id, str) or not self.transfer_id:
            raise ValueError("kv_transfer_params transfer_id must be a non-empty string")
        if self.remote is not None and (not isinstance(self.remote, str) or ":" not in self.remote):
            raise ValueError(f"kv_transfer_params remote must be host:port, got {self.remote!r}")
