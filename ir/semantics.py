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

What blocks (the buffered semantics of the format)
--------------------------------------------------
- `send` never blocks: the message is buffered;
- `recv` blocks until its matching send has run;
- `reduce-tied NAME` blocks until every rank holding a stage of the tie has reached it;
- `allreduce stage S` is among the data-parallel replicas of this pipeline rank, which run the
  same stream: it never waits on another pipeline rank;
- everything else runs at once.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

import networkx as nx

from tpc.ir.nodes import Header, Instr, Op, Payload

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
        if s > 0 and header.stage_rank(s - 1) != rank:
            recvs.append((ACT, header.stage_rank(s - 1), input_message(ACT, s, m, i)))
        if s < last and header.stage_rank(s + 1) != rank:
            sends.append((ACT, header.stage_rank(s + 1), output_message(ACT, s, m, i)))
    elif instr.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        if s < last and header.stage_rank(s + 1) != rank:
            recvs.append((GRAD, header.stage_rank(s + 1), input_message(GRAD, s, m, i)))
        if s > 0 and header.stage_rank(s - 1) != rank:
            sends.append((GRAD, header.stage_rank(s - 1), output_message(GRAD, s, m, i)))
    return recvs, sends


def tie_ranks(header: Header, name: str) -> tuple[int, ...]:
    """The pipeline ranks holding a stage of tie `name` (the members of its reduce-tied), in
    rank order; () for an undeclared tie."""
    for tie in header.ties:
        if tie.name == name:
            return tuple(sorted({header.stage_rank(s) for s in tie.stages}))
    return ()


def allreduce_covers(stage_rank: Sequence[int], ties: Iterable[Iterable[int]], stage: int) -> frozenset[int]:
    """The stages whose gradients `allreduce stage S` reduces: S, and every stage on S's rank
    joined to it by ties (`stage_rank[s]` the rank of stage s, `ties` the stages of each tie).
    A tied parameter of two stages on one rank is one tensor, reduced by the first allreduce of
    either; so each of those allreduces must come after the backwards of all of them."""
    rank, tie_sets = stage_rank[stage], [set(t) for t in ties]
    group, todo = {stage}, [stage]
    while todo:
        s = todo.pop()
        for tie in tie_sets:
            if s in tie:
                new = {t for t in tie if 0 <= t < len(stage_rank) and stage_rank[t] == rank} - group
                group |= new
                todo += new
    return frozenset(group)


def blocks(op: Op) -> bool:
    """Whether an instruction can wait on another pipeline rank: a receive (for its send) or a
    reduce-tied (for the tie's other ranks). Sends are buffered; allreduce waits only on
    replicas running the same stream."""
    return op is Op.RECV or op is Op.REDUCE_TIED


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
