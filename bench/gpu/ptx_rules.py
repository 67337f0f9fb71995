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
what the rules look for. Two of them are thread-level calls (a signal operation, NVSHMEM's fence):
each thread that makes one issues an operation of its own (an IBGDA atomic each: 128 for one
signal at 4 warps), so each must lie behind a branch that only a program's thread 0 falls
through (`unguarded_calls`); and every signal operation must SET its word (NVSHMEM_SIGNAL_SET,
9, not 0, which NVSHMEM reads as no operation its transfer knows and its load/store path as an
add: a credit would grow by its value instead of taking it).
"""

from __future__ import annotations

import collections
import re

COMM_MODULE = "peer_copy"
PUT_NVSHMEM = 2  # peer_copy.PUT_NVSHMEM: the launch's constexpr KIND (sends) or PUT (credits)

ACQUIRE_WAIT = (("atom", "ld"), {"sys", "acquire"}, "the waits are system-scope acquire loads")
RELEASE_SIGNAL = (("atom",), {"sys", "release", "exch"}, "the signal word is a system-scope release exchange")
RELEASE_CREDIT = (("atom", "red"), {"sys", "release", "max"}, "the credit is a system-scope release max")
SLOT_COUNTER = (("atom",), {"gpu", "acq_rel", "add"}, "the per-slot completion counter is an acq_rel add at GPU scope")
BOUNDED = ((), {"globaltimer"}, "the waits are bounded by the global timer")
# A plain load of the error word may be hoisted out of a spin loop; a volatile one is re-read each time round.
REREAD = (("ld",), {"volatile"}, "the waits re-read the error word with a volatile load")

# kernel -> the instructions that must each occur at least once in its PTX: (opcodes, qualifiers, what it proves)
REQUIRED: dict[str, list[tuple[tuple[str, ...], set[str], str]]] = {
    "dispatch_send_kernel": [RELEASE_SIGNAL, ACQUIRE_WAIT, BOUNDED, REREAD],
    "wait_signals_kernel": [ACQUIRE_WAIT, BOUNDED, REREAD],
    "dispatch_recv_kernel": [SLOT_COUNTER, RELEASE_CREDIT],
    "combine_send_kernel": [RELEASE_SIGNAL, ACQUIRE_WAIT, BOUNDED, REREAD],
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
FENCE = "nvshmemi_transfer_fence"
THREAD_LEVEL = (SIGNAL_OP, FENCE)  # the calls one thread of a program must make alone
NVSHMEM_SIGNAL_SET = 9  # nvshmemx_signal_op_t's SET: the amo type a signal operation passes its transfer
_TID = re.compile(r"mov\.u32\s+(%r\d+),\s*%tid\.x;")
_TID_SETP = re.compile(r"setp\.(eq|ne)\.\w+\s+(%p\d+),\s*(%r\d+),\s*0;")
_PRED_OP = re.compile(r"\b(or|and|not)\.pred\s+(%p\d+),\s*([^;]+);")
_BRANCH = re.compile(r"@(!?)(%p\d+)\s+bra(?:\.uni)?\s+(\$\w+);")
_AMO_TYPE = re.compile(r"st\.param\.b32\s+\[param3\],\s*(\d+);")
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
    # A function's closing brace is the first at a line's start after its end label (an inline
    # asm block's own braces may start a line too).
    end = ptx.find("\n}", max(start, ptx.find("$L__func_end", start)))
    return ptx[start : end + 2] if end >= 0 else ptx[start:]


def _thread_predicates(body: str) -> tuple[set[str], set[str]]:
    """(predicates true in every thread but thread 0, predicates true in thread 0 alone), from the
    comparisons with 0 of `%tid.x` (or of an `or` with it: the compiler folds `program 0's thread
    0` into one) and what `or`/`and`/`not` make of them; a predicate register
    written more than once is neither (it may hold something else where it is read)."""
    writes = collections.Counter(re.findall(r"^\s*(?:setp|or|and|not|xor|mov)\.\S+\s+(%p\d+),", body, re.M))
    tids = set(_TID.findall(body))  # registers nonzero wherever %tid.x is: it, and ors of it
    ors = re.findall(r"\bor\.b32\s+(%r\d+),\s*(%r\d+),\s*(%r\d+);", body)
    while grown := {r for r, a, b in ors if r not in tids and {a, b} & tids}:
        tids |= grown
    others = {p for op, p, r in _TID_SETP.findall(body) if r in tids and op == "ne"}
    leader = {p for op, p, r in _TID_SETP.findall(body) if r in tids and op == "eq"}
    grew = True
    while grew:
        before = len(others) + len(leader)
        for op, p, args in _PRED_OP.findall(body):
            sources = {a.strip() for a in args.split(",")}
            if op == "or" and sources & others or op == "not" and sources & leader:
                others.add(p)
            if op == "and" and sources & leader or op == "not" and sources & others:
                leader.add(p)
        grew = len(others) + len(leader) > before
    once = {p for p, n in writes.items() if n == 1}
    return others & once, leader & once


def _blocks(body: str) -> tuple[list[list[str]], dict[str, int]]:
    """The kernel's instructions cut into basic blocks (a label starts one, a branch or a return
    ends one), and each label's block."""
    blocks: list[list[str]] = [[]]
    labels: dict[str, int] = {}
    for raw in body.splitlines():
        line = raw.split("//", 1)[0].strip()
        if re.fullmatch(r"\$\w+:", line):
            blocks.append([])
            labels[line[:-1]] = len(blocks) - 1
        elif line:
            blocks[-1].append(line)
            if re.search(r"\b(bra|ret|exit)\b", line):
                blocks.append([])
    return blocks, labels


def _successors(blocks: list[list[str]], labels: dict[str, int], i: int, ways=lambda negated, pred: (True, True)):
    """Block i's successors; `ways(negated, pred)` says whether a conditional branch may be taken
    and whether it may fall through."""
    last = blocks[i][-1] if blocks[i] else ""
    branch = _BRANCH.search(last)
    unconditional = re.match(r"bra(\.uni)?\s+(\$\w+);", last)
    if branch:
        taken, falls = ways(*branch.groups()[:2])
        out = ([labels.get(branch.group(3), len(blocks))] if taken else []) + ([i + 1] if falls else [])
    elif unconditional:
        out = [labels.get(unconditional.group(2), len(blocks))]  # not in the body: out of it
    elif re.search(r"\b(ret|exit)\b", last):
        out = []
    else:
        out = [i + 1]
    return [j for j in out if j < len(blocks)]


def unguarded_calls(body: str, names: tuple[str, ...] = THREAD_LEVEL) -> list[str]:
    """The calls of `names` in a kernel's PTX that a thread other than thread 0 can reach: the
    control flow from the entry with every branch on `%tid.x != 0` (or its negation) followed
    the way such a thread goes, every other branch both ways."""
    others, leader = _thread_predicates(body)
    blocks, labels = _blocks(body)

    def ways(negated: str, pred: str) -> tuple[bool, bool]:
        always = pred in (leader if negated else others)  # every thread but 0 jumps
        never = pred in (others if negated else leader)  # no thread but 0 jumps
        return not never, not always

    reached, todo = {0}, [0]
    while todo:
        for j in _successors(blocks, labels, todo.pop(), ways):
            if j not in reached:
                reached.add(j)
                todo.append(j)
    return [
        called
        for i in sorted(reached)
        for line in blocks[i]
        for called in _CALL.findall(line)
        if any(name in called for name in names)
    ]


def releases_without_barrier(body: str) -> int:
    """The system-scope release exchanges (signal words) that some path reaches from a global
    store with no block barrier on the way: the exchange is one thread's, the rows it publishes
    every thread's, so without `bar.sync` between them a receiver running concurrently may see
    the signal before some rows."""
    blocks, labels = _blocks(body)

    def is_release(line: str) -> bool:
        return bool(re.search(r"\batom\.\S*\.release\.\S*exch|\batom\.\S*\.sys\.release\.exch", line))

    def is_store(line: str) -> bool:
        return bool(re.search(r"\bst\.global", line)) and not is_release(line)

    unordered: set[tuple[int, int]] = set()
    for start, block in enumerate(blocks):
        stores = [k for k, line in enumerate(block) if is_store(line)]
        if not stores:
            continue
        todo, seen = [(start, stores[-1] + 1)], set()
        while todo:
            i, k = todo.pop()
            for at, line in enumerate(blocks[i][k:], k):
                if line.startswith(("bar.sync", "barrier")):
                    break
                if is_release(line) and ".sys" in line:
                    unordered.add((i, at))
            else:
                for j in _successors(blocks, labels, i):
                    if j not in seen:
                        seen.add(j)
                        todo.append((j, 0))
    return len(unordered)


def signal_ops_not_set(body: str) -> list[int]:
    """The amo types that the kernel's signal operations pass other than NVSHMEM_SIGNAL_SET."""
    types = []
    for block in body.split("{ // callseq")[1:]:
        block = block.split("} // callseq", 1)[0]
        if SIGNAL_OP in block:
            types += [int(t) for t in _AMO_TYPE.findall(block) if int(t) != NVSHMEM_SIGNAL_SET]
    return types


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
    unguarded = unguarded_calls(body)
    if unguarded:
        problems.append(f"every thread of a program makes the thread-level call(s) {sorted(set(unguarded))}, not one")
    wrong = signal_ops_not_set(body)
    if wrong:
        problems.append(f"a signal operation passes amo type(s) {sorted(set(wrong))}, not SET ({NVSHMEM_SIGNAL_SET})")
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
    unordered = releases_without_barrier(body)
    if unordered:
        problems.append(f"{unordered} release exchange(s) follow the rows' stores with no block barrier between")
    if put:
        problems += check_put_ptx(kernel, ptx, load_store_peers)
    if kernel not in COPY_KERNELS:
        return None, problems
    vector = bool(_VECTOR_LOAD.search(body)) and bool(_VECTOR_STORE.search(body))
    if not vector:
        problems.append("payload rows are copied with scalar loads/stores, not 128-bit ld/st.global.v4.b32")
    return vector, problems
