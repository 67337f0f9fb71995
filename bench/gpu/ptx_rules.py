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
"""

from __future__ import annotations

import re

COMM_MODULE = "peer_copy"

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
_INSTRUCTION = re.compile(r"\b(atom|red|ld|st)((?:\.\w+)+)")


def _has(ptx: str, opcodes: tuple[str, ...], qualifiers: set[str]) -> bool:
    if not opcodes:  # a special register, not an instruction
        return all(f"%{q}" in ptx for q in qualifiers)
    return any(op in opcodes and qualifiers <= set(quals.split(".")[1:]) for op, quals in _INSTRUCTION.findall(ptx))


# kernel -> the payload copies that must be 128-bit
COPY_KERNELS = ("dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel")
_VECTOR_LOAD = re.compile(r"ld\.global(\.\w+)*\.v4\.b32")
_VECTOR_STORE = re.compile(r"st\.global(\.\w+)*\.v4\.b32")


def check_comm_ptx(kernel: str, ptx: str) -> tuple[bool | None, list[str]]:
    """(whether its payload copies are 128-bit, or None where it copies no payload; the problems)."""
    problems = [
        f"PTX lacks what shows {proves} ({'/'.join(ops) or 'register'} with {'.'.join(sorted(quals))})"
        for ops, quals, proves in REQUIRED.get(kernel, [])
        if not _has(ptx, ops, quals)
    ]
    if kernel not in COPY_KERNELS:
        return None, problems
    vector = bool(_VECTOR_LOAD.search(ptx)) and bool(_VECTOR_STORE.search(ptx))
    if not vector:
        problems.append("payload rows are copied with scalar loads/stores, not 128-bit ld/st.global.v4.b32")
    return vector, problems
