"""What a plan means: the one definition of its messages, their channels and what blocks.

Every part that reads a plan's communication uses this module: lowering (which sends and
receives a compute needs), the verifier (pairing, FIFO order, deadlock), the simulator and the
timeline (which receive a send reaches), and both executors (the key of a value in a rank's
environment, the check that a received message is the one expected).

Messages
--------
A message is one tensor crossing one stage boundary: boundary `b` is the edge between stage `b`
and stage `b + 1`. An activation crosses it forward (stage b's output, stage b+1's input), a
gradient backward (the gradient of stage b+1's input, which is the gradient of stage b's
output). So a message is named the same way on both ends by

    Message(payload, boundary, mb, slice)

whatever instruction names it: `send act stage S` and `recv act stage S+1` both name boundary
S; `send grad stage S+1` and `recv grad stage S` both name boundary S. The same name is the key
of the value inside a rank, where two stages on one rank hand it over without a message.

Channels and matching
---------------------
A send on rank `src` to `dst` and a receive on `dst` from `src` use the channel (src, dst). A
receive matches the send of the same message on its channel. Within a channel messages are
received in the order they were sent (FIFO); the verifier (rule F1) checks that the plan's
order makes this hold, so executors may match by order alone.

What blocks: the rules of a backend
-----------------------------------
A plan runs under the rules of the backend that carries its messages, named by `COMMS`:

- `gloo` (buffered sends): a `send` never blocks (the message is buffered); a `recv` blocks
  until its matching send has run. The format's own semantics: the interpreter runs it, and
  every valid plan satisfies it (verifier rule D1).
- `nccl` (rendezvous sends): a send completes only when its receive is posted, and a rank's
  sends and receives, to every peer and in both directions, run in issue order on one
  communicator and stream (PyTorch's NCCL process group, to which the executor gives every one
  as a `batch_isend_irecv`). A plan satisfies these
  rules when every rank can run with each point-to-point operation blocking the rank until its
  partner operation is posted: an `exchange N` (format version 2) makes its N sends and
  receives one operation, issued together (`batch_isend_irecv`) and complete together, so two
  ranks that must send to each other at the same time exchange instead of waiting for each
  other. Blocking the rank is stricter than NCCL (which blocks only the stream), so a plan
  that passes cannot hang on NCCL whatever the message sizes. Verifier rule D1 under `nccl`.

Under both rules:
- `reduce-tied NAME` blocks until every rank holding a stage of the tie has reached it;
- `reduce-replicas stage S` (format version 3) blocks until every rank holding a weight replica
  of stage S has reached it;
- `allreduce stage S` is among the data-parallel replicas of this pipeline rank, which run the
  same stream: it never waits on another pipeline rank; so is `reduce-loss`, the evaluation
  program's sum of its loss over those replicas;
- everything else runs at once.

`comm_entries` cuts a rank's stream into what can block (one send or receive, one exchange, one
reduce-tied) and `run_comm` runs all ranks under a backend's rules: the verifier, lowering and
the interpreter's rendezvous mode all use them.
The evaluation program (format version 2, `Plan.evaluation()`) is a plan like any other here:
its forwards exchange activations by the same messages, one direction per pair of ranks.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

import networkx as nx

from tpc.ir.nodes import COMPUTE_OPS, Header, Instr, Op, Payload

ACT, GRAD = Payload.ACT, Payload.GRAD


class Message(NamedTuple):
    """One tensor crossing one stage boundary (see the module docstring). A tuple: plans have
    100k messages and every pass hashes them."""

    payload: Payload
    boundary: int
    mb: int
    slice: int

    @property
    def sender_stage(self) -> int:
        """The stage that produces it: b for an activation, b + 1 for a gradient."""
        return self.boundary if self.payload is ACT else self.boundary + 1

    @property
    def receiver_stage(self) -> int:
        """The stage that consumes it: b + 1 for an activation, b for a gradient."""
        return self.boundary + 1 if self.payload is ACT else self.boundary

    def __str__(self) -> str:
        """'act stage 1 mb 0 slice 2': the message as the receiving stage's input (activation)
        or output gradient (gradient)."""
        return f"{self.payload.value} stage {self.receiver_stage} mb {self.mb} slice {self.slice}"


def boundary(instr: Instr) -> int:
    """The stage boundary a send or receive crosses: `send act S` and `recv grad S` cross S,
    `recv act S` and `send grad S` cross S - 1."""
    forward_going = instr.payload is ACT
    sending = instr.op is Op.SEND
    return instr.stage if forward_going == sending else instr.stage - 1


def message(instr: Instr) -> Message:
    """The message a send or receive names."""
    return Message(instr.payload, boundary(instr), instr.mb, instr.slice)


def output_message(payload: Payload, stage: int, mb: int, slice_: int) -> Message:
    """What a compute of `stage` hands on: its output activation (to stage + 1) or the
    gradient of its input (to stage - 1)."""
    b = stage if payload is ACT else stage - 1
    return Message(payload, b, mb, slice_)


def input_message(payload: Payload, stage: int, mb: int, slice_: int) -> Message:
    """What a compute of `stage` takes: its input activation (from stage - 1) or the gradient
    of its output (from stage + 1)."""
    b = stage - 1 if payload is ACT else stage
    return Message(payload, b, mb, slice_)


def neighbour_stage(instr: Instr) -> int:
    """The stage at the other end of a send or receive."""
    m = message(instr)
    return m.receiver_stage if instr.op is Op.SEND else m.sender_stage


def channel(rank: int, instr: Instr) -> tuple[int, int]:
    """(sender rank, receiver rank) of a send or receive on pipeline rank `rank`."""
    return (rank, instr.peer) if instr.op is Op.SEND else (instr.peer, rank)


def message_key(rank: int, instr: Instr) -> tuple:
    """(src, dst, message): a send and its receive have the same key."""
    return (*channel(rank, instr), message(instr))


def compute_messages(header: Header, rank: int, instr: Instr) -> tuple[list, list]:
    """(received, sent) by a compute on pipeline rank `rank`: lists of (payload, peer rank,
    Message) for its input and output crossing to another rank. A forward receives its input
    activation and sends its output; a backward (or backward-input) receives its output
    gradient and sends its input gradient. Other instructions exchange nothing."""
    s, m, i = instr.stage, instr.mb, instr.slice
    last = header.num_stages - 1
    recvs, sends = [], []
    if instr.op is Op.FORWARD:
        if s > 0 and header.stage_rank(s - 1, m) != rank:
            recvs.append((ACT, header.stage_rank(s - 1, m), input_message(ACT, s, m, i)))
        if s < last and header.stage_rank(s + 1, m) != rank:
            sends.append((ACT, header.stage_rank(s + 1, m), output_message(ACT, s, m, i)))
    elif instr.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        if s < last and header.stage_rank(s + 1, m) != rank:
            recvs.append((GRAD, header.stage_rank(s + 1, m), input_message(GRAD, s, m, i)))
        if s > 0 and header.stage_rank(s - 1, m) != rank:
            sends.append((GRAD, header.stage_rank(s - 1, m), output_message(GRAD, s, m, i)))
    return recvs, sends


def message_shape(header: Header, mb: int, sl: int, hidden: int) -> tuple[int, int, int]:
    """The shape of every message of micro-batch `mb`, token slice `sl` (an activation or its
    gradient): (the micro-batch's rows, the slice's tokens, the hidden size); with
    `sequence-parallel`, each tensor rank's 1/T of the slice's tokens. Known from the header
    alone, so a receive is posted with its shape and no shape is ever sent."""
    lo, hi = header.microbatches[mb].slices[sl]
    mesh = header.mesh
    tokens = (hi - lo) // mesh.tensor if mesh.sequence else hi - lo
    return header.microbatches[mb].size, tokens, hidden


def replica_group(stage: int) -> tuple:
    """The key of `reduce-replicas stage S` among the collectives `run_comm` waits on (a tie's
    key is its name)."""
    return ("replicas", stage)


def collective_groups(header: Header) -> dict:
    """The members of every collective between pipeline ranks, by key: each tie's ranks (its
    name) and each replicated stage's ranks (`replica_group(S)`), for `run_comm`."""
    groups: dict = {t.name: frozenset(header.tie_ranks(t.name)) for t in header.ties}
    for st in header.stages:
        if st.replicas:
            groups[replica_group(st.index)] = frozenset(st.ranks)
    return groups


def tie_ranks(header: Header, name: str) -> tuple[int, ...]:
    """The pipeline ranks holding a stage of tie `name` (the members of its reduce-tied), in
    rank order; () for an undeclared tie."""
    return header.tie_ranks(name)


def allreduce_covers(stage_rank: Sequence[int | Sequence[int]], ties: Iterable[Iterable[int]], stage: int,
                     rank: int | None = None) -> frozenset[int]:
    """The stages whose gradients `allreduce stage S` on pipeline rank `rank` reduces: S, and
    every stage on that rank joined to it by ties (`stage_rank[s]` the rank of stage s, or the
    ranks of its weight replicas; `ties` the stages of each tie; `rank` defaults to S's only or
    first rank). A tied parameter of two stages on one rank is one tensor, reduced by the first
    allreduce of either; so each of those allreduces must come after the backwards of all of
    them."""
    held = [(r,) if isinstance(r, int) else tuple(r) for r in stage_rank]
    rank = held[stage][0] if rank is None else rank
    tie_sets = [set(t) for t in ties]
    group, todo = {stage}, [stage]
    while todo:
        s = todo.pop()
        for tie in tie_sets:
            if s in tie:
                new = {t for t in tie if 0 <= t < len(held) and rank in held[t]} - group
                group |= new
                todo += new
    return frozenset(group)


# ------------------------------------------------------------------ the backends' rules

class Spelled(str, Enum):
    """A `str` enum read from a flag's spelling: `Kind("x")` or `Kind.of("x")`, printed as its
    value. `spelling()` names what it is, for the error of an unknown spelling."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def spelling(cls) -> str:
        return "value"

    @classmethod
    def of(cls, value):
        """`value` as a member, or its spelling; ValueError otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {cls.spelling()} {value!r}: use "
                             + " or ".join(c.value for c in cls)) from None


class CommRules(Spelled):
    """The communication rules a plan is lowered, verified, simulated and run under (the module
    docstring), named by the backend whose rules they are. A `str` enum: `CommRules("gloo")`
    reads a flag's spelling, and a value prints as its name."""

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def spelling(cls) -> str:
        return "communication rules"

    @property
    def summary(self) -> str:
        return COMMS[self]



GLOO, NCCL = CommRules.GLOO, CommRules.NCCL
# The one default: a plan is lowered, verified and simulated under NCCL's rules unless told
# otherwise. A plan valid under them is valid under gloo's too (they block strictly more), so
# the default plan runs on both backends.
DEFAULT_COMM = NCCL
# the rules a plan can be checked and run under (the module docstring), by backend name
COMMS: dict[CommRules, str] = {
    GLOO: "buffered sends: a send never blocks, a receive waits for its send",
    NCCL: "rendezvous sends: a send or receive completes only when its partner is posted, one "
          "FIFO per rank pair; an exchange's sends and receives complete together",
}



def blocks(op: Op, comm: CommRules = DEFAULT_COMM) -> bool:
    """Whether an instruction can wait on another pipeline rank under `comm`'s rules: a
    receive (for its send), a reduce-tied (for the tie's other ranks), and under `nccl` a send
    (for its receive) and an exchange. Allreduce waits only on replicas running the same
    stream."""
    if op is Op.RECV or op is Op.REDUCE_TIED or op is Op.REDUCE_REPLICAS:
        return True
    return comm == NCCL and op in (Op.SEND, Op.EXCHANGE)


class RecvAhead:
    """When a rank running under gloo's buffered rules posts each of its receives: ahead of its
    instruction, up to the `computes`-th compute from the instruction about to run, while the
    buffers posted and not yet received hold at most `max_bytes`, in program order, and never
    past a collective or `step` (nothing is received beyond one until it is reached); a receive
    not posted by then is posted at its own instruction (`post`).

    The distributed executor posts by it (executors/distributed.py, `before_instruction`), and
    the memory model counts a receive's buffer from the instruction it is posted at
    (compiler/predict/memory.py). `nbytes(index)`: the bytes of the receive at `index`. Under NCCL's
    rules each receive is issued at its own instruction: `computes=0`."""

    COMPUTES = 8  # bench/recv_lookahead.py: steps 0.7-7% shorter than 2 on 2 CPU ranks
    MAX_BYTES = 16 * 2**20

    _BARRIERS = frozenset({Op.ALLREDUCE, Op.REDUCE_TIED, Op.REDUCE_REPLICAS, Op.STEP, Op.REDUCE_LOSS})

    def __init__(self, instrs: Sequence[Instr], nbytes, computes: int = COMPUTES, max_bytes: int = MAX_BYTES):
        self.instrs, self.nbytes, self.computes, self.max_bytes = instrs, nbytes, computes, max_bytes
        self.reset()

    def reset(self) -> None:
        """A new step: nothing posted."""
        self.next, self.posted, self.held = 0, set(), 0

    def before(self, index: int) -> list[int]:
        """The receives to post now, about to run instruction `index`, in program order (a
        receive not posted by the time its own instruction runs is posted there)."""
        out = []
        computes, j = 0, max(self.next, index)
        for k in range(index, j):  # the computes between index and where posting stopped
            computes += self.instrs[k].op in COMPUTE_OPS
        while j < len(self.instrs) and computes < self.computes:
            ins = self.instrs[j]
            if ins.op is Op.RECV:
                if j > index and self.held + self.nbytes(j) > self.max_bytes:
                    break  # posted when the budget allows, or at its own instruction
                out.append(self._post(j))
            elif ins.op in COMPUTE_OPS:
                computes += 1
            elif ins.op in self._BARRIERS:
                break
            j += 1
        self.next = max(self.next, j)
        return out

    def post(self, index: int) -> None:
        """The receive at `index` is posted at its own instruction (it was not ahead)."""
        if index not in self.posted:
            self._post(index)

    def _post(self, index: int) -> int:
        self.posted.add(index)
        self.held += self.nbytes(index)
        return index

    def taken(self, index: int) -> None:
        """The receive at `index` ran: its buffer left the posted ones."""
        if index in self.posted:
            self.posted.discard(index)
            self.held -= self.nbytes(index)


def exchange_span(instrs: Sequence[Instr], p: int) -> range:
    """The positions of the members of the `exchange N` at position p: the N instructions
    after it (fewer at the end of the stream)."""
    return range(p + 1, min(len(instrs), p + 1 + (instrs[p].count or 0)))


@dataclass(frozen=True)
class Entry:
    """What can block on a rank: one send or receive, one exchange (at its `exchange` line, with
    its members), or one collective between pipeline ranks (a reduce-tied, a reduce-replicas).
    `p2p` are (position, message key, is a send, peer) for each send and receive, in stream
    order; `tie` the collective's key (`collective_groups`)."""

    at: int
    p2p: tuple[tuple[int, tuple, bool, int], ...] = ()
    tie: str | tuple | None = None


def comm_entries(rank: int, instrs: Sequence[Instr], keep=None) -> list[Entry]:
    """Rank `rank`'s stream as the entries that can block, in order. `keep(p)` may leave out
    instructions (the verifier leaves out those that failed the operand rules)."""
    out: list[Entry] = []
    p, n = 0, len(instrs)
    while p < n:
        ins = instrs[p]
        if keep is not None and not keep(p):
            p += 1
            continue
        if ins.op is Op.EXCHANGE:
            span = exchange_span(instrs, p)
            members = tuple((q, message_key(rank, instrs[q]), instrs[q].op is Op.SEND, instrs[q].peer)
                            for q in span if instrs[q].op in (Op.SEND, Op.RECV)
                            and (keep is None or keep(q)))
            out.append(Entry(p, members))
            p = span.stop
            continue
        if ins.op in (Op.SEND, Op.RECV):
            out.append(Entry(p, ((p, message_key(rank, ins), ins.op is Op.SEND, ins.peer),)))
        elif ins.op is Op.REDUCE_TIED:
            out.append(Entry(p, tie=ins.tie))
        elif ins.op is Op.REDUCE_REPLICAS:
            out.append(Entry(p, tie=replica_group(ins.stage)))
        p += 1
    return out


@dataclass
class Stuck:
    """Where a rank stays for ever: the instruction it blocks on and the ranks it waits for."""

    at: int
    waits_for: list[int]
    # the message keys it waits to be matched (empty for a reduce-tied)
    missing: list[tuple]
    entry: int = 0  # the index of its entry in its rank's entries


def run_comm(entries: Sequence[Sequence[Entry]], tie_ranks: Mapping[str, frozenset[int]],
             comm: CommRules, repair=None) -> dict[int, Stuck]:
    """Run every rank's entries under `comm`'s rules (GLOO or NCCL, the module docstring);
    the ranks that never finish, with where they block. Every receive must have its one
    send (the verifier runs this only then). A reduce-tied of a tie not in `tie_ranks` is
    skipped.

    `repair(stuck) -> {rank: [message keys]}` (NCCL only; lowering uses it) may, when every
    rank is stuck, add operations to the blocked ranks' current entries (`entries` are then
    lists it changes in place, `Stuck.entry` saying which); the run goes on with those
    operations posted, and ends when `repair` returns nothing."""
    n = len(entries)
    ptr = [0] * n
    sub = [0] * n  # gloo: the next member of the current entry
    sent: set[tuple] = set()  # gloo: messages sent
    posted: dict[tuple, int] = {}  # nccl: message key -> rank whose current entry posts it
    matched: set[tuple] = set()  # nccl: keys both of whose ends were posted together
    waiting_msg: dict[tuple, int] = {}
    arrived: dict[str, set[int]] = {}
    done_ties: set[str] = set()
    waiting_tie: dict[str, list[int]] = {}
    ready = deque(range(n))
    nccl = comm == NCCL

    def post_key(r: int, key: tuple) -> None:
        """nccl: rank r posts its end of `key`; matched when the other end is posted."""
        other = posted.pop(key, None)
        if other is None:
            posted[key] = r
        else:
            matched.add(key)
            ready.append(other)

    def post(r: int) -> None:
        """nccl: rank r has reached its current entry: post its ends."""
        for _, key, _, _ in entries[r][ptr[r]].p2p:
            post_key(r, key)

    def advance(r: int) -> None:
        ptr[r] += 1
        sub[r] = 0
        if nccl and ptr[r] < len(entries[r]) and entries[r][ptr[r]].p2p:
            post(r)

    for r in range(n):
        if nccl and entries[r] and entries[r][0].p2p:
            post(r)
    while True:
        _drain(entries, tie_ranks, nccl, ptr, sub, sent, matched, waiting_msg, arrived,
               done_ties, waiting_tie, ready, advance)
        stuck = _stuck(entries, tie_ranks, nccl, ptr, sub, matched, arrived)
        added = repair(stuck) if stuck and repair is not None and nccl else None
        if not added:
            return stuck
        for r, keys in added.items():
            for key in keys:
                post_key(r, key)
            ready.append(r)


def _drain(entries, tie_ranks, nccl, ptr, sub, sent, matched, waiting_msg, arrived, done_ties,
           waiting_tie, ready, advance) -> None:
    """Run ranks from `ready` until none can move (the body of `run_comm`)."""
    while ready:
        r = ready.popleft()
        stream = entries[r]
        while ptr[r] < len(stream):
            e = stream[ptr[r]]
            if e.tie is not None:
                if e.tie not in tie_ranks or e.tie in done_ties:
                    advance(r)
                    continue
                got = arrived.setdefault(e.tie, set())
                got.add(r)
                if got >= tie_ranks[e.tie]:
                    done_ties.add(e.tie)
                    ready.extend(waiting_tie.pop(e.tie, []))
                    advance(r)
                    continue
                waiting_tie.setdefault(e.tie, []).append(r)
                break
            if nccl:
                if all(key in matched for _, key, _, _ in e.p2p):
                    advance(r)
                    continue
                break
            # gloo: the members in order; a receive waits for its send
            while sub[r] < len(e.p2p):
                _, key, is_send, _ = e.p2p[sub[r]]
                if is_send:
                    sent.add(key)
                    if key in waiting_msg:
                        ready.append(waiting_msg.pop(key))
                elif key not in sent:
                    waiting_msg[key] = r
                    break
                sub[r] += 1
            if sub[r] < len(e.p2p):
                break
            advance(r)


def _stuck(entries, tie_ranks, nccl, ptr, sub, matched, arrived) -> dict[int, Stuck]:
    """Where each unfinished rank blocks (the end of `run_comm`)."""
    n = len(entries)
    stuck: dict[int, Stuck] = {}
    for r in range(n):
        if ptr[r] >= len(entries[r]):
            continue
        e = entries[r][ptr[r]]
        if e.tie is not None:
            stuck[r] = Stuck(e.at, sorted(tie_ranks[e.tie] - arrived.get(e.tie, set())), [],
                               ptr[r])
        elif nccl:
            missing = [(p, key, peer) for p, key, _, peer in e.p2p if key not in matched]
            stuck[r] = Stuck(missing[0][0], sorted({peer for _, _, peer in missing}),
                               [key for _, key, _ in missing], ptr[r])
        else:
            p, key, _, peer = e.p2p[sub[r]]
            stuck[r] = Stuck(p, [peer], [key], ptr[r])
    return stuck


def wait_chain(waits_for: Mapping[int, Iterable[int]], start: int) -> list[int]:
    """The ranks a blocked rank waits on, transitively: `start`, the rank it waits for, the
    rank that one waits for, ... up to and including the first rank seen twice (the wait-for
    cycle that makes a deadlock), or up to a rank that waits on nobody still blocked.
    `waits_for[r]` are the ranks blocked rank r waits for; only ranks that are keys are
    blocked. Found with networkx on the wait-for graph."""
    graph = nx.DiGraph()
    graph.add_nodes_from(waits_for)
    graph.add_edges_from((r, q) for r, qs in waits_for.items() for q in qs if q in waits_for)
    try:
        cycle = nx.find_cycle(graph, source=start)
    except nx.NetworkXNoCycle:
        path = [start]
        while graph.out_degree(path[-1]):
            path.append(next(iter(graph.successors(path[-1]))))
        return path
    entry = cycle[0][0]
    path = nx.shortest_path(graph, start, entry)
    return path + [v for _, v in cycle]
