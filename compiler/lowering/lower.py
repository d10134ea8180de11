"""Lowering: from per-rank compute orders to a complete plan.

A schedule builder gives each pipeline rank its forward/backward order. Lowering adds everything
else an executor needs, one small named pass at a time, each a pure function
`(header, streams) -> streams` over `dict[rank, tuple[Instr, ...]]`:

1. `insert_loads`      `load mb M` on the ranks of the first and last stage, just before the
                       first instruction of that micro-batch there (ids on the first, targets
                       on the last);
2. `insert_comm`       `recv` right before the compute that needs a remote input, `send` right
                       after the compute that produced it - unless an earlier-needed message on
                       the same channel is not sent yet, in which case the send waits for it, so
                       messages between two ranks are sent in the order they are received
                       (FIFO per direction; executors need no tags);
   `pair_slices`       (`pairs=True`, `tpc compile --tensor-overlap` only) the forwards of slices
                       i and i + 1 of one stage and micro-batch brought together, and their
                       backwards (i + 1's, then i's): the second's receive goes before the
                       first compute, the first's send after the second compute, so a
                       tensor-parallel executor runs the two as one program whose collectives
                       overlap the other slice's compute (compiler/tensor/overlap.py);
3. `insert_free_kv`    `free-kv stage S mb M` after the last compute of (S, M) and its sends;
4. `insert_allreduce`  `allreduce stage S` after the last backward of S, when data > 1;
5. `insert_exchanges`  (for NCCL's rules, tpc.ir.semantics) the sends and receives that ranks
                       must post at the same time become one `exchange N` on each rank;
   `order_exchanges`   (`--exchanges ordered` only) each exchange written back as its single
                       sends and receives, in an order NCCL's rules run without a batch;
6. `insert_reduce_tied` `reduce-tied "NAME"` for each tie spanning several ranks, after every
                       backward and allreduce of the rank, in header order on every rank, so
                       the collectives of different ties can never wait on each other;
7. `insert_reduce_replicas` `reduce-replicas stage S` (format version 3) for each stage with
                       weight replicas, on each rank holding one, after everything else, in
                       stage order: the two ranks of a pair of replicas reach their reductions
                       in one order, with no message left to wait for;
8. `append_step`       `step` at the end.

`lower(header, compute, comm=..., exchanges=..., pairs=...)` runs them in that order and checks the result
with the verifier under the rules of `comm` (NCCL, `DEFAULT_COMM`, unless told GLOO: then
`insert_exchanges` is left out, since buffered sends need no exchange).

How `insert_exchanges` finds the exchanges, from any compute order (no schedule is special):
on NCCL a send completes only when its receive is posted, and the sends and receives between
two ranks run in one FIFO shared by both directions, so ranks that each send before they
receive wait for each other for ever: 1F1B's steady state (the activation one way, the gradient
the other), or a ring of sends around the ranks (interleaved stages). The pass runs the ranks
under NCCL's rules (`tpc.ir.semantics.run_comm`, the verifier's own simulation); when they stop
in a wait-for cycle, each rank of the cycle is blocked at an operation whose partner its
successor posts later: that partner moves up into the successor's blocked operation, and the
two become one exchange (batched, like Megatron's send_forward_recv_backward). A receive may
always move up (it needs only its buffer, and stays above its consumer); a send only past no
compute. The run then goes on, so every cycle is broken where it first appears, and a send is
never delayed. An exchange is written where its first operation was, sends first. A cycle that
cannot be broken this way is left for the verifier to report.

How `order_exchanges` writes an exchange as single operations (`Exchanges.ORDERED`, for GPUs on
which a batched send/receive hangs): each send and receive then blocks its rank on its own, so
the members of the ranks' exchanges need one order that every rank follows. The pass takes the
batched plan's events (a message, matched when both its ends are posted; a collective) and the
order each rank imposes on them (every event of an entry before every event of the rank's next
entry: `semantics.comm_entries`), a directed graph, and sorts it topologically, choosing among
the events that are free the one with the lowest (sender rank, receiver rank, sender position).
Each rank writes each exchange's members in that order, and each receive among them goes back
down past the computes towards its consumer (single, it would hold the compute after it), but
never past another operation. The order is deadlock-free under NCCL's
rules: the earliest event not yet done has, on each of its ranks, every earlier operation done,
so both its ends are posted. In a cycle of two ranks the lower rank sends first and the higher
receives first; in a ring the lowest rank sends first and every other rank receives first. The
graph has a cycle exactly when the batched plan deadlocks too (an event of a later entry is
matched only after the earlier entries' events), so ordering resolves every plan batching
does; the result is run once more under NCCL's rules (`check_ordered`) before it is written,
and a plan that still blocks is refused, naming its schedule and ranks.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import networkx as nx

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import BACKWARD_OPS, COMPUTE_OPS, Header, Instr, Op, Payload, Plan, RankProgram
from tpc.ir.semantics import (
    DEFAULT_COMM,
    GLOO,
    NCCL,
    CommRules,
    Spelled,
    Entry,
    Stuck,
    allreduce_covers,
    collective_groups,
    comm_entries,
    compute_messages,
    run_comm,
    wait_chain,
)

Streams = dict[int, tuple[Instr, ...]]
Pass = Callable[[Header, Streams], Streams]


class Exchanges(Spelled):
    """How a plan for NCCL's rules carries the sends and receives that ranks must post at the
    same time (the module docstring): one `exchange N` each, issued as one `batch_isend_irecv`
    (BATCHED), or single operations in an order that runs without a batch (ORDERED). A `str`
    enum: `Exchanges("ordered")` reads a flag's spelling."""

    BATCHED = "batched"
    ORDERED = "ordered"

    @classmethod
    def spelling(cls) -> str:
        return "exchange lowering"

    @property
    def summary(self) -> str:
        return EXCHANGES[self]


# The default: batched, one operation for the group, where both ranks' transfers overlap
DEFAULT_EXCHANGES = Exchanges.BATCHED
EXCHANGES: dict[Exchanges, str] = {
    Exchanges.BATCHED: "each group of sends and receives ranks must post together is one "
                       "`exchange N`, one batch_isend_irecv",
    Exchanges.ORDERED: "no batch: the group's single sends and receives, in an order NCCL's rules "
                       "run (in a pair of ranks the lower sends first), one after another",
}
# what an ordered plan says on its `schedule` line (a comment: no new syntax)
ORDERED_NOTE = "--exchanges ordered: single sends and receives, no batch_isend_irecv of several"
PAIRED_NOTE = "--tensor-overlap: the forwards and backwards of slice pairs brought together, each pair run as one program"


# ------------------------------------------------------------------------------- helpers


def _is_compute(instr: Instr) -> bool:
    return instr.op in COMPUTE_OPS


def _insert(stream: Sequence[Instr], before: Mapping[int, list[Instr]], after: Mapping[int, list[Instr]]):
    """`stream` with `before[i]` inserted before position i and `after[i]` after it."""
    out: list[Instr] = []
    for i, instr in enumerate(stream):
        out += before.get(i, [])
        out.append(instr)
        out += after.get(i, [])
    return tuple(out)


def _tail_end(stream: Sequence[Instr], index: int, stages: set[int]) -> int:
    """The position after `stream[index]` and the bookkeeping that directly follows it (sends,
    free-kv, allreduce of `stages`): where an instruction "after index" goes, so that what is
    attached to the compute is not pushed away from it."""
    j = index + 1
    while j < len(stream) and stream[j].op in (Op.SEND, Op.FREE_KV, Op.ALLREDUCE) and stream[j].stage in stages:
        j += 1
    return j


def _splice(stream: Sequence[Instr], at: Mapping[int, list[Instr]]) -> tuple[Instr, ...]:
    """`stream` with `at[p]` inserted before position p (p may be len(stream))."""
    out: list[Instr] = []
    for p in range(len(stream) + 1):
        out += at.get(p, [])
        if p < len(stream):
            out.append(stream[p])
    return tuple(out)


# ---------------------------------------------------------------------------------- passes


def insert_loads(header: Header, streams: Streams) -> Streams:
    """`load mb M` on the first and last stage's ranks, before the first instruction of mb M
    that belongs to the first or last stage (once per rank when one rank holds both). Over packed
    documents every stage reads the micro-batch's document boundaries: every rank loads it."""
    ends = set(range(header.num_stages)) if header.documents is not None else {0, header.num_stages - 1}
    out: Streams = {}
    for rank, stream in streams.items():
        before: dict[int, list[Instr]] = defaultdict(list)
        seen: set[int] = set()
        for i, instr in enumerate(stream):
            if _is_compute(instr) and instr.stage in ends and instr.mb not in seen:
                seen.add(instr.mb)
                before[i].append(Instr(Op.LOAD, mb=instr.mb))
        out[rank] = _insert(stream, before, {})
    return out


def insert_comm(header: Header, streams: Streams) -> Streams:
    """Send/recv for every activation and gradient crossing ranks (see the module docstring).

    Receives go right before their compute. On each channel (sender -> receiver) the sends are
    ordered as the receiver needs them: a send goes after its producing compute and after the
    send of every message the receiver needs earlier. When the compute orders of both ranks
    agree (all built-in schedules) that is simply right after the producer."""
    recv_order: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> keys
    produced: dict[tuple, tuple[int, int, int]] = {}  # key -> (src rank, position, dst rank)
    before: dict[int, dict[int, list[Instr]]] = {r: defaultdict(list) for r in streams}
    for rank, stream in streams.items():
        for p, instr in enumerate(stream):
            recvs, sends = compute_messages(header, rank, instr)
            for payload, peer, key in recvs:
                recv_order[(peer, rank)].append(key)
                before[rank][p].append(
                    Instr(Op.RECV, payload=payload, stage=instr.stage, mb=instr.mb, slice=instr.slice, peer=peer)
                )
            for payload, peer, key in sends:
                produced[key] = (rank, p, peer)

    # position of each send: after its producer and after every send the receiver needs first
    placed: dict[int, list[tuple[int, int, tuple]]] = defaultdict(list)  # src -> (pos, seq, key)
    seq = 0
    for (src, dst), keys in sorted(recv_order.items()):
        floor = -1
        for key in keys:
            if key not in produced:
                continue  # never produced: the verifier reports the unmatched receive
            floor = max(floor, produced[key][1])
            placed[src].append((floor, seq, key))
            seq += 1
    wanted = {key for keys in recv_order.values() for key in keys}
    for key, (src, pos, _dst) in sorted(produced.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if key not in wanted:  # never received: send it anyway; the verifier reports it
            placed[src].append((pos, seq, key))
            seq += 1

    out: Streams = {}
    for rank, stream in streams.items():
        after: dict[int, list[Instr]] = defaultdict(list)
        for pos, _, msg in sorted(placed.get(rank, [])):
            after[pos].append(Instr(Op.SEND, payload=msg.payload, stage=msg.sender_stage, mb=msg.mb,
                                    slice=msg.slice, peer=produced[msg][2]))
        out[rank] = _insert(stream, before[rank], after)
    return out


def paired(a: Instr, b: Instr) -> Payload | None:
    """Whether computes `a` then `b` are two a pair runs as one program: the forwards of slices
    i and i + 1 (neither checkpointed), or the backwards (or backward-inputs) of slices i + 1
    and i, of one stage and micro-batch. Returns the payload of the messages between them
    (activations, gradients), or None."""
    if a.op is Op.FORWARD and b.op is Op.FORWARD and not (a.checkpoint or b.checkpoint):
        return Payload.ACT if b.key == (a.stage, a.mb, a.slice + 1) else None
    if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and b.op is a.op:
        return Payload.GRAD if b.key == (a.stage, a.mb, a.slice - 1) else None
    return None


def pair_slices(header: Header, streams: Streams) -> Streams:
    """Bring two computes of consecutive slices of a stage and micro-batch together (`paired`:
    forwards of i and i + 1, backwards of i + 1 and i), where only the send of the first's
    result and the receive of the second's input come between them (`insert_comm` puts them
    there): the receive moves before the first compute, the send after the second. The pairs
    are taken in stream order and do not overlap (0 with 1, 2 with 3, ..., unless something
    else stands between two computes)."""
    out: Streams = {}
    for rank, stream in streams.items():
        s = list(stream)
        i = 0
        while i < len(s):
            a = s[i]
            k = i + 1
            while k < len(s) and s[k].op in (Op.SEND, Op.RECV):
                k += 1
            b = s[k] if k < len(s) else None
            payload = paired(a, b) if b is not None else None
            if payload is None:
                i += 1
                continue
            between = s[i + 1:k]
            sends = [x for x in between if x.op is Op.SEND and x.payload is payload and x.key == a.key]
            recvs = [x for x in between if x.op is Op.RECV and x.payload is payload and x.key == b.key]
            if len(sends) + len(recvs) != len(between):
                i += 1
                continue
            s[i:k + 1] = recvs + [a, b] + sends
            i += len(recvs) + 2 + len(sends)
        out[rank] = tuple(s)
    return out


def insert_free_kv(header: Header, streams: Streams) -> Streams:
    """`free-kv stage S mb M` after the last instruction about (S, M) on its rank: its last
    compute (the KV cache and its gradients are needed until the last slice's backward) and
    any send of its results, which `insert_comm` may have delayed past later computes."""
    out: Streams = {}
    for rank, stream in streams.items():
        last: dict[tuple[int, int], int] = {}
        for p, instr in enumerate(stream):
            if _is_compute(instr) or instr.op in (Op.SEND, Op.RECV):
                last[(instr.stage, instr.mb)] = p
        at: dict[int, list[Instr]] = defaultdict(list)
        for (s, m), p in sorted(last.items(), key=lambda kv: kv[1]):
            at[_tail_end(stream, p, {s})].append(Instr(Op.FREE_KV, stage=s, mb=m))
        out[rank] = _splice(stream, at)
    return out


def insert_allreduce(header: Header, streams: Streams) -> Streams:
    """`allreduce stage S` after the last backward of S (and what follows it), when there is
    more than one data-parallel replica; the reduction of stage S overlaps the backwards of
    the rank's other stages. A stage tied to another stage of its rank waits for the last
    backward of both (`semantics.allreduce_covers`: the tied tensor is reduced once)."""
    if header.mesh.data <= 1:
        return dict(streams)
    out: Streams = {}
    for rank, stream in streams.items():
        last: dict[int, int] = {}
        for p, instr in enumerate(stream):
            if instr.op in BACKWARD_OPS:
                last[instr.stage] = p
        ranks = [st.ranks for st in header.stages]
        covers = {s: allreduce_covers(ranks, (t.stages for t in header.ties), s, rank) for s in last}
        after = {s: max(last.get(t, -1) for t in covers[s]) for s in last}
        at: dict[int, list[Instr]] = defaultdict(list)
        for s, p in sorted(after.items(), key=lambda kv: (kv[1], kv[0])):
            at[_tail_end(stream, p, set(covers[s]))].append(Instr(Op.ALLREDUCE, stage=s))
        out[rank] = _splice(stream, at)
    return out


def insert_exchanges(header: Header, streams: Streams) -> Streams:
    """Run the ranks under NCCL's rules; at each wait-for cycle, make each blocked rank's
    operation one exchange with the operation its predecessor in the cycle waits for (see the
    module docstring); then write each exchange at its first operation, sends first."""
    ranks = sorted(streams)
    entries = [list(comm_entries(r, streams[r])) for r in ranks]
    where: dict[tuple[int, tuple], int] = {}  # (rank, message key) -> entry index
    for r in ranks:
        for k, e in enumerate(entries[r]):
            for _, key, _, _ in e.p2p:
                where[(r, key)] = k
    groups = collective_groups(header)

    def repair(stuck: dict[int, Stuck]) -> dict[int, list[tuple]]:
        """Join, along one wait-for cycle, the operation each rank waits for to the entry its
        partner is blocked at; {} when no cycle can be broken that way."""
        waits = {r: b.waits_for for r, b in stuck.items()}
        for start in sorted(stuck):
            chain = wait_chain(waits, start)
            if len(chain) < 2 or chain[-1] not in chain[:-1]:
                continue  # no cycle from here
            cycle = chain[chain.index(chain[-1]):]
            added: dict[int, list[tuple]] = {}
            for r, q in zip(cycle, cycle[1:]):
                # r waits for q to post the other end of one of r's operations: move it up
                key = next((k for k in stuck[r].missing if (q, k) in where), None)
                if key is None:
                    continue
                later, current = where[(q, key)], stuck[q].entry
                if later <= current or not _can_move_up(streams[q], entries[q], current, later, key):
                    continue
                op = next(o for o in entries[q][later].p2p if o[1] == key)
                rest = tuple(o for o in entries[q][later].p2p if o[1] != key)
                entries[q][later] = Entry(entries[q][later].at, rest)
                entries[q][current] = Entry(entries[q][current].at, entries[q][current].p2p + (op,))
                where[(q, key)] = current
                added.setdefault(q, []).append(key)
            if added:
                return added
        return {}

    run_comm(entries, groups, NCCL, repair=repair)
    out: Streams = {}
    for r in ranks:
        stream = streams[r]
        at: dict[int, list[int]] = {}
        moved: set[int] = set()
        for e in entries[r]:
            if len(e.p2p) > 1:
                members = ([p for p, _, is_send, _ in e.p2p if is_send]
                           + [p for p, _, is_send, _ in e.p2p if not is_send])
                at[e.at] = members
                moved.update(members)
        new: list[Instr] = []
        for p, instr in enumerate(stream):
            if p in at:
                new.append(Instr(Op.EXCHANGE, count=len(at[p])))
                new += [stream[q] for q in at[p]]
            elif p not in moved:
                new.append(instr)
        out[r] = tuple(new)
    return out


def _can_move_up(stream: Sequence[Instr], entries: list, current: int, later: int, key) -> bool:
    """Whether the operation of `key` in entry `later` may join entry `current`: a receive
    always may (it only needs its buffer, and stays above its consumer); a send only when no
    compute lies between (its producer comes right before it)."""
    op = next(o for o in entries[later].p2p if o[1] == key)
    if not op[2]:
        return True
    return not any(_is_compute(stream[p]) for p in range(entries[current].at, op[0]))


def order_exchanges(header: Header, streams: Streams) -> Streams:
    """Each `exchange N` written as its N sends and receives, in the order of the topological
    sort of the plan's events (the module docstring), so that single operations, each blocking
    its rank until its partner is posted, run without a batch. Checked by `check_ordered`. A
    plan that deadlocks batched too is written with each exchange's members as they were, for
    the verifier to report."""
    ranks = sorted(streams)
    entries = {r: comm_entries(r, streams[r]) for r in ranks}
    groups = collective_groups(header)
    graph = nx.DiGraph()
    priority: dict = {}
    for r in ranks:
        before: tuple = ()
        for e in entries[r]:
            if e.tie is not None:
                if e.tie not in groups:
                    continue  # run_comm skips it too
                events: tuple = (("collective", e.tie),)
                priority[events[0]] = (1, repr(e.tie))
            else:
                events = tuple(key for _, key, _, _ in e.p2p)
                for p, key, is_send, _ in e.p2p:
                    if is_send or key not in priority:  # the sender's position decides
                        priority[key] = (0, key[0], key[1], p)
            graph.add_nodes_from(events)
            graph.add_edges_from((u, v) for u in before for v in events if u != v)
            before = events
    try:
        order = {ev: i for i, ev in enumerate(nx.lexicographical_topological_sort(graph, key=priority.__getitem__))}
    except nx.NetworkXUnfeasible:  # deadlocks batched too: the verifier says where
        order = {}
    out: Streams = {}
    for r in ranks:
        stream = streams[r]
        members: dict[int, list[int]] = {}
        inside: set[int] = set()
        for e in entries[r]:
            if stream[e.at].op is Op.EXCHANGE:
                ops = sorted(e.p2p, key=lambda o: order.get(o[1], 0))  # stable: as written
                members[e.at] = [p for p, _, _, _ in ops]
                inside.update(range(e.at, e.at + 1 + (stream[e.at].count or 0)))
        new: list[Instr] = []
        moved: list[int] = []  # positions in `new` of the exchanges' receives
        for p, instr in enumerate(stream):
            if p in members:
                for q in members[p]:
                    if stream[q].op is Op.RECV:
                        moved.append(len(new))
                    new.append(stream[q])
            elif p not in inside:
                new.append(instr)
        for at in reversed(moved):
            _sink(new, at)
        out[r] = tuple(new)
    if order:
        check_ordered(header, out)
    return out


def _sink(stream: list[Instr], at: int) -> None:
    """Move the receive at `at` down past the computes (and loads, free-kvs) of other (stage,
    micro-batch)s, up to its consumer or the rank's next other instruction. An exchange's
    receive was moved up to its partner's send; single, it holds what follows it on the rank
    (NCCL orders the compute after it), so it goes back towards its consumer, but never past
    another send, receive or collective: the order of the rank's operations, which
    `order_exchanges` chose, is kept."""
    recv = stream[at]
    j = at
    while j + 1 < len(stream):
        nxt = stream[j + 1]
        passable = nxt.op in COMPUTE_OPS or nxt.op in (Op.LOAD, Op.FREE_KV)
        if not passable or (nxt.stage, nxt.mb) == (recv.stage, recv.mb):
            break
        j += 1
    if j > at:
        stream[at:j + 1] = stream[at + 1:j + 1] + [recv]


def check_ordered(header: Header, streams: Streams) -> None:
    """Refuse (a TpirError at `--exchanges`) single sends and receives that block under NCCL's
    rules: the ranks of the wait cycle, where each waits, and what would run instead."""
    ranks = sorted(streams)
    stuck = run_comm([comm_entries(r, streams[r]) for r in ranks], collective_groups(header), NCCL)
    if not stuck:
        return
    waits = {r: b.waits_for for r, b in stuck.items()}
    chain = wait_chain(waits, min(stuck))
    cycle = chain[chain.index(chain[-1]):-1] if chain[-1] in chain[:-1] else chain
    where = "; ".join(f"rank {r} at `{streams[r][stuck[r].at]}`, waiting for rank "
                      f"{', '.join(map(str, stuck[r].waits_for))}" for r in cycle)
    names = ", ".join(map(str, cycle[:-1])) + f" and {cycle[-1]}" if len(cycle) > 1 else str(cycle[0])
    raise TpirError(Diagnostic(
        f"schedule {header.schedule.name!r}: the exchanges of ranks {names} cannot run as single "
        f"sends and receives in this order under NCCL's rules (each blocks its rank until its "
        f"partner is posted): {where}",
        hint="compile with --exchanges batched (the default): the sends and receives those ranks "
             "must post together become one `exchange`, issued as one batch_isend_irecv",
        where="--exchanges"))


def insert_reduce_tied(header: Header, streams: Streams) -> Streams:
    """`reduce-tied "NAME"` at the end of each rank holding a stage of a tie that spans more
    than one rank. Placing them after every backward and allreduce, in header order, means
    every rank adds up the same (already data-reduced) contributions and the ties' collectives
    run in the same order everywhere."""
    out: Streams = {}
    for rank, stream in streams.items():
        extra = []
        for tie in header.ties:
            ranks = header.tie_ranks(tie.name)
            if len(ranks) > 1 and rank in ranks:
                extra.append(Instr(Op.REDUCE_TIED, tie=tie.name))
        out[rank] = tuple(stream) + tuple(extra)
    return out


def insert_reduce_replicas(header: Header, streams: Streams) -> Streams:
    """`reduce-replicas stage S` at the end of each rank holding a weight replica of S, in stage
    order (see the module docstring): the replicas' gradients are summed before the step. It
    does not overlap the backward: every rank of a replica pair must have no message left to
    wait for when it blocks in the reduction."""
    out: Streams = {}
    for rank, stream in streams.items():
        extra = tuple(Instr(Op.REDUCE_REPLICAS, stage=st.index) for st in header.stages
                      if st.replicas and rank in st.ranks)
        out[rank] = tuple(stream) + extra
    return out


def append_step(header: Header, streams: Streams) -> Streams:
    """`step` last on every rank: the optimizer step needs every gradient reduced."""
    return {rank: tuple(stream) + (Instr(Op.STEP),) for rank, stream in streams.items()}


PASSES: tuple[tuple[str, Pass], ...] = (
    ("insert_loads", insert_loads),
    ("insert_comm", insert_comm),
    ("pair_slices", pair_slices),
    ("insert_free_kv", insert_free_kv),
    ("insert_allreduce", insert_allreduce),
    ("insert_exchanges", insert_exchanges),
    ("order_exchanges", order_exchanges),
    ("insert_reduce_tied", insert_reduce_tied),
    ("insert_reduce_replicas", insert_reduce_replicas),
    ("append_step", append_step),
)


def to_plan(header: Header, streams: Streams) -> Plan:
    """The plan with one rank section per pipeline rank, in rank order."""
    ranks = tuple(RankProgram(rank=r, instrs=tuple(streams.get(r, ()))) for r in range(header.mesh.pipe))
    return Plan(header=header, ranks=ranks)


def noted_header(header: Header, note: str) -> Header:
    """`header` with `note` at the end of its `schedule` line (once): a reader of the plan sees
    how it was lowered (a comment: the plan's meaning is its instructions)."""
    line = header.schedule
    text = note if not line.note else (line.note if note in line.note else f"{line.note}; {note}")
    return dataclasses.replace(header, schedule=line.with_trivia(note=text))


def ordered_header(header: Header) -> Header:
    """`header` with `ORDERED_NOTE` on its `schedule` line."""
    return noted_header(header, ORDERED_NOTE)


def passes_for(comm: CommRules = DEFAULT_COMM, exchanges: Exchanges = DEFAULT_EXCHANGES, pairs: bool = False) -> tuple:
    """The passes `lower` runs for backend `comm` and the exchange lowering `exchanges`: without
    `insert_exchanges` for GLOO, with `order_exchanges` only for NCCL with ORDERED, with
    `pair_slices` only when `pairs`."""
    exchanges = Exchanges.of(exchanges)
    skip = ({"insert_exchanges", "order_exchanges"} if comm == GLOO
            else set() if exchanges is Exchanges.ORDERED else {"order_exchanges"})
    skip |= set() if pairs else {"pair_slices"}
    return tuple((name, run) for name, run in PASSES if name not in skip)


def lower(header: Header, compute: Mapping[int, Sequence[Instr]], *, verify: bool = True,
          comm: CommRules = DEFAULT_COMM, exchanges: Exchanges = DEFAULT_EXCHANGES, pairs: bool = False) -> Plan:
    """Run every pass over the schedule's compute order and return the plan for backend `comm`
    (NCCL: with exchanges, batched or `exchanges=ORDERED`; GLOO: without), verified under its
    rules unless `verify=False` (for a caller that checks it itself, as `tpc compile` does in a
    step of its own, or a test that studies an unverifiable intermediate). An ordered plan says
    so on its `schedule` line (`ordered_header`), and so does one with paired forwards (`pairs`:
    `pair_slices`)."""
    streams: Streams = {r: tuple(compute.get(r, ())) for r in range(header.mesh.pipe)}
    for _, run in passes_for(comm, exchanges, pairs):
        streams = run(header, streams)
    if comm == NCCL and Exchanges.of(exchanges) is Exchanges.ORDERED:
        header = ordered_header(header)
    if pairs:
        header = noted_header(header, PAIRED_NOTE)
    plan = to_plan(header, streams)
    if verify:
        from tpc.ir.verify import check

        check(plan, comm)
    return plan
