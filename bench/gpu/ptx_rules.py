"""What the communication kernels' PTX must hold for the all-to-all protocol to be correct and fast
on a GPU, checked on PTX compiled on a CPU machine (see `compile_check.py`).

The protocol (`moeserve.kernels.peer_copy`) orders a group's rows before its signal word with a
release exchange at system scope, and the receiver's reads of the rows after its wait with acquire
loads at system scope (Triton turns an `atomic_add` of 0 whose result is used into `ld.acquire`
where it can): peers are other GPUs (NVLink), so `.gpu` scope would be too weak. Every wait reads
`%globaltimer`, the bound that turns a dead peer into an error rather than a hang. The
per-slot completion counter is an acquire-release add at GPU scope (only this GPU's programs use
it). Credits only grow (`atom.max`), so two streams finishing out of order cannot move one back.
Payload rows move in 16-byte words (`ld/st.global.v4.b32`): scalar copies cut the bandwidth of
a copy loop to a fraction.

The put variants (`KIND`/`PUT` = `PUT_NVSHMEM`: peers on other nodes) must hand every send to
NVSHMEM: the rows with their signal in one put-with-signal (or, for combine's scattered rows,
puts, then a fenced signal), the credits as signal operations. Their payload stores go only to
the local staging region, so they must hold none of the store path's code: no system-scope
release exchange, the store that publishes rows stored into a peer (a peer on another node has
no address; such a store would write local memory at a meaningless address). Where the rank has
no load/store peer at all (`DOMAIN` 0: every peer, itself included, by puts) the credit kernels'
put variants must hold no store-path credit either: every credit is a signal operation.
NVSHMEM's `nvshmemx_*` entry points are inlined into the kernel; what remains of each is a call
to its transfer routine for peers without a load/store path (IBGDA, or its proxy where IBGDA is
off): `nvshmemi_transfer_put_signal*` for a put-with-signal, `nvshmemi_transfer_rma_nbi*` for a
non-blocking put, `nvshmemi_transfer_amo_nonfetch*` for a signal operation. Those calls are
what the rules look for.
"""

from __future__ import annotations

import re

COMM_MODULE = "peer_copy"
PUT_NVSHMEM = 2  # peer_copy.PUT_NVSHMEM: the launch's constexpr KIND (sends) or PUT (credits)

ACQUIRE_WAIT = (("atom", "ld"), {"sys", "acquire"}, "the waits are system-scope acquire loads")
RELEASE_SIGNAL = (("atom",), {"sys", "release", "exch"}, "the signal word is a system-scope release exchange")
RELEASE_CREDIT = (("atom", "red"), {"sys", "release", "max"}, "the credit is a system-scope release max")
SLOT_COUNTER = (("atom",), {"gpu", "acq_rel", "add"}, "the per-slot completion counter is an acq_rel add at GPU scope")
BOUNDED = ((), {"globaltimer"}, "the waits are bounded by the global timer")

# kernel -> the instructions that must each occur at least once in its PTX: (opcodes, qualifiers, what it proves)
REQUIRED: dict[str, list[tuple[tuple[str, ...], set[str], str]]] = {
    "dispatch_send_kernel": [RELEASE_SIGNAL, ACQUIRE_WAIT, BOUNDED],
    "wait_signals_kernel": [ACQUIRE_WAIT, BOUNDED],
    "dispatch_recv_kernel": [SLOT_COUNTER, RELEASE_CREDIT],
    "combine_send_kernel": [RELEASE_SIGNAL, ACQUIRE_WAIT, BOUNDED],
    "notify_send_kernel": [RELEASE_SIGNAL],
    "give_credit_kernel": [RELEASE_CREDIT],
}
PUT_SIGNAL, PUT_NBI, SIGNAL_OP = "nvshmemi_transfer_put_signal", "nvshmemi_transfer_rma_nbi", "nvshmemi_transfer_amo"
# kernel -> (NVSHMEM transfer routines its put variant must call, whether the store path's signal must be absent)
PUT_CALLS: dict[str, tuple[tuple[str, ...], bool]] = {
    "dispatch_send_kernel": ((PUT_SIGNAL,), True),
    "combine_send_kernel": ((PUT_NBI, SIGNAL_OP), True),
    "notify_send_kernel": ((PUT_SIGNAL,), True),
    "dispatch_recv_kernel": ((SIGNAL_OP,), False),  # credits to in-domain peers stay stores
    "give_credit_kernel": ((SIGNAL_OP,), False),
}
_CALL = re.compile(r"\bcall(?:\.uni)?\s*(?:\([^)]*\),\s*)?(\w+)")
_INSTRUCTION = re.compile(r"\b(atom|red|ld|st)((?:\.\w+)+)")


def _has(ptx: str, opcodes: tuple[str, ...], qualifiers: set[str]) -> bool:
    if not opcodes:  # a special register, not an instruction
        return all(f"%{q}" in ptx for q in qualifiers)
    return any(op in opcodes and qualifiers <= set(quals.split(".")[1:]) for op, quals in _INSTRUCTION.findall(ptx))


# kernel -> the payload copies that must be 128-bit
COPY_KERNELS = ("dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel")
_VECTOR_LOAD = re.compile(r"ld\.global(\.\w+)*\.v4\.b32")
_VECTOR_STORE = re.compile(r"st\.global(\.\w+)*\.v4\.b32")


def _kernel_body(ptx: str, kernel: str) -> str:
    """The kernel's own function: NVSHMEM's linked device code (its own atomics and stores) excluded."""
    start = ptx.find(f".entry {kernel}")
    if start < 0:
        return ptx
    end = ptx.find("\n}", start)  # a function's closing brace is the only one at a line's start
    return ptx[start : end + 2] if end >= 0 else ptx[start:]


def check_put_ptx(kernel: str, ptx: str, load_store_peers: bool = True) -> list[str]:
    """The problems of a put variant's PTX (see the module docstring)."""
    calls, no_store_signal = PUT_CALLS.get(kernel, ((), False))
    body = _kernel_body(ptx, kernel)
    made = _CALL.findall(body)
    problems = [f"the put variant never calls NVSHMEM's {name}" for name in calls if not any(name in m for m in made)]
    if no_store_signal and _has(body, *RELEASE_SIGNAL[:2]):
        problems.append("the put variant holds the store path's release exchange (a store into a peer)")
    if not load_store_peers and _has(body, *RELEASE_CREDIT[:2]):
        problems.append("the put variant for no load/store peer holds the store path's credit (a store into a peer)")
    return problems


def check_comm_ptx(
    kernel: str, ptx: str, put: bool = False, load_store_peers: bool = True
) -> tuple[bool | None, list[str]]:
    """(whether its payload copies are 128-bit, or None where it copies no payload; the problems).
    put: the kernel was compiled as a put variant (NVSHMEM linked). load_store_peers: False where
    it was compiled for no load/store peer (`DOMAIN` 0), so that every credit is a put."""
    dropped = ([RELEASE_SIGNAL] if put else []) + ([RELEASE_CREDIT] if put and not load_store_peers else [])
    required = [rule for rule in REQUIRED.get(kernel, []) if not any(rule is d for d in dropped)]
    body = _kernel_body(ptx, kernel)
    problems = [
        f"PTX lacks what shows {proves} ({'/'.join(ops) or 'register'} with {'.'.join(sorted(quals))})"
        for ops, quals, proves in required
        if not _has(body, ops, quals)
    ]
    if put:
        problems += check_put_ptx(kernel, ptx, load_store_peers)
    if kernel not in COPY_KERNELS:
        return None, problems
    vector = bool(_VECTOR_LOAD.search(body)) and bool(_VECTOR_STORE.search(body))
    if not vector:
        problems.append("payload rows are copied with scalar loads/stores, not 128-bit ld/st.global.v4.b32")
    return vector, problems
