"""Prefill/decode disaggregation: KV blocks moved from a prefill instance's paged cache to a
decode instance's over NIXL, arranged over an HTTP side channel (see docs/architecture.md)."""
