"""Discrete-event simulation of a plan: predicted timeline, bubble, critical path and memory.

`simulate(plan, costs, comm)` runs every rank's stream under a cost model and the communication
rules `comm` (NCCL's unless told GLOO, `DEFAULT_COMM`), and honours every ordering rule of
docs/ir.md. Under gloo's rules (`comm=GLOO`, buffered sends):

* program order: a rank runs one instruction at a time, in the order written;
* a `send` never blocks and takes no time on the sender (it is buffered; the transfer runs on
  the link); its `recv` ends at max(when the receiver reaches it, when the send ran + the
  transfer time `p2p_time(activation_bytes(l, mb_size))`). Messages between two ranks are
  matched by what they carry (payload, the stage boundary crossed, micro-batch, slice), first
  sent first received;
* a receive inside an `exchange` (posted with its sends, `batch_isend_irecv`) does not hold its
  rank: the executor waits for it where its value is used, so the compute that consumes it
  starts at max(its own turn, the message's arrival) and carries the wait. (The simulation
  predicts time, not deadlock freedom: the verifier checks that under the backend's rules.)
* with `comm=NCCL` (the default, `DEFAULT_COMM`; `tpc simulate --comm nccl`), NCCL's rules instead: each rank's sends and
  receives run in issue order on one stream (every one a `batch_isend_irecv`, an exchange one
  batch), and a message moves only once both its send and its receive have started. So an
  operation starts at max(when its rank issues it, when that rank's previous operation ended),
  a message ends at max(its send's start, its receive's start) + the transfer time, and a
  batch ends with its last message. The host never waits for a send: a receive outside an
  exchange holds its rank until its message ends, an exchange's receive holds the compute that
  uses it, and `step` waits for every send of the rank (the executor's flush). Every time is
  then at least its buffered value: the rules only add waits;
* `reduce-tied NAME` starts when every rank holding a stage of the tie has reached it (the
  k-th `reduce-tied NAME` of each rank together), then costs an all-reduce of the tied bytes
  over those ranks;
* `reduce-replicas stage S` (format version 3) likewise waits for every rank holding a weight
  replica of S, then costs an all-reduce of `param_bytes(S)` (the gradients) over them;
* `reduce-loss` (the evaluation program, `Plan.evaluation()`, which simulates like any plan)
  costs an all-reduce of one float64 over the data-parallel replicas;
* `allreduce stage S` costs the cost model's `grad_sync_time(S, data)` (by default a ring
  all-reduce of `param_bytes(S)` over the data-parallel replicas; they run identical streams,
  so nobody waits for anybody);
* compute costs `slice_time(stage, l, c, mb_size)`: forward and recompute the first number,
  backward the second. A split backward's `backward-input` and `backward-weight` cost the
  cost model's `split_backward_time(stage, l, c, mb_size)` -> (t_input, t_weight) (the
  profiled model: both halves measured by `tpc profile`, uneven and together more than a plain
  backward; the other models: half the backward each, `CostModel`'s default).

Times are in the cost model's unit (seconds, or abstract units under `UnitCosts`). Every
instruction becomes an `Event`; the part of an event spent waiting for a peer (a receive
waiting for its send, a tie waiting for the other ranks) is `wait`, the rest is `work`. A
rank's busy time is the sum of its work; its idle time is the iteration time minus that, and
its bubble fraction is idle / iteration time. The iteration starts at 0 on every rank and ends
when the last instruction of any rank ends.

The critical path is found by walking back from the last event to end: each event records what
made it start when it did (the previous instruction of its rank, or the send a receive waited
for, or the last rank to reach a tie's reduction).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.predict.memory import Memory, rank_memory, slice_extent
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import COMPUTE_OPS, Header, Instr, Op, Plan
from tpc.ir.semantics import (DEFAULT_COMM, GLOO, NCCL, CommRules, RecvAhead, compute_messages, exchange_span, message_key, replica_group,
                               tie_ranks)

# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Event:
    """One instruction as it ran: [start, end) of which `wait` was spent waiting for a peer."""

    rank: int
    index: int  # position in the rank's stream
    instr: Instr
    start: float
    end: float
    wait: float = 0.0
    # a receive: when its data is there (its end, or later for an exchange's receive, which the
    # compute using it waits for)
    arrival: float | None = None

    @property
    def line(self) -> int | None:
        """The .tpir line of the instruction (None for a plan built in memory)."""
        return self.instr.loc.line if self.instr.loc is not None else None

    @property
    def work(self) -> float:
        return self.end - self.start - self.wait


@dataclass(frozen=True)
class RankStats:
    rank: int
    busy: float  # time doing the rank's own work (compute and collectives)
    compute: float  # of which forward/recompute/backward
    idle: float  # iteration time - busy
    bubble: float  # idle / iteration time
    peak_memory: Memory  # breakdown at the rank's peak


@dataclass(frozen=True)
class SimResult:
    plan: Plan
    iteration_time: float
    events: tuple[Event, ...]  # by rank, then program order
    ranks: tuple[RankStats, ...]
    critical_path: tuple[Event, ...]  # from the first instruction to the last to finish
    time_unit: str = "s"
    memory_unit: str = "B"
    shard_optimizer: bool = False  # the memory is that of a run with --shard-optimizer

    def events_of(self, rank: int) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.rank == rank)

    @property
    def bubble(self) -> float:
        """Mean bubble fraction over the ranks."""
        return statistics.fmean(r.bubble for r in self.ranks) if self.ranks else 0.0


# ------------------------------------------------------------------------------- simulation


def _compute_time(header: Header, instr: Instr, costs: CostModel) -> float:
    l, c, size = slice_extent(header, instr)
    if instr.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
        t_input, t_weight = costs.split_backward_time(instr.stage, l, c, size)
        return t_input if instr.op is Op.BACKWARD_INPUT else t_weight
    t_fwd, t_bwd = costs.slice_time(instr.stage, l, c, size)
    return t_fwd if instr.op in (Op.FORWARD, Op.RECOMPUTE) else t_bwd


def _tie_ranks(header: Header, rank: int, instr: Instr) -> tuple[int, ...]:
    ranks = tie_ranks(header, instr.tie)
    if ranks:
        return ranks
    raise TpirError(
        Diagnostic(
            f"rank {rank} reduces tie {instr.tie!r}, which the header does not declare",
            loc=instr.loc,
            where=f"rank {rank}: `{instr}`",
            hint="declare it with a `tie` line, or run `tpc verify` first",
        )
    )


class _Comm:
    """One point-to-point operation of a rank under NCCL's rules: a send, a receive, or an
    exchange's batch; `members` are (message key, is a send, transfer time, position)."""

    def __init__(self, rank: int, issued: float, prev: "_Comm | None"):
        self.rank, self.issued, self.prev = rank, issued, prev
        self.members: list[tuple] = []
        self.end: tuple | None = None


class _Sim:
    """The state of one simulation; `run` advances every rank as far as its dependencies let
    it, round after round, until all are done or none can move (a deadlock)."""

    def __init__(self, plan: Plan, costs: CostModel, comm: CommRules = DEFAULT_COMM):
        comm = CommRules.of(comm)
        self.nccl = comm == NCCL
        self.plan = plan
        self.header = plan.header
        self.costs = costs
        self.streams = [p.instrs for p in plan.ranks]
        self.pos = [0] * len(self.streams)
        self.clock = [0.0] * len(self.streams)
        self.events: dict[tuple[int, int], Event] = {}
        self.pred: dict[tuple[int, int], tuple[int, int] | None] = {}
        self.sent: dict[tuple, deque] = {}
        self.tie_seen: dict[tuple[int, str], int] = {}  # (rank, tie) -> reductions done
        self.tie_arrivals: dict[tuple[str, int], dict[int, tuple[float, int]]] = {}
        self.exchange_end = [0] * len(self.streams)  # the position after a rank's current exchange
        # (rank, message key) -> (arrival, sender's event) of an exchange's receive not yet used
        # (under NCCL's rules the arrival is the exchange's operation, `_Comm`, until it is known)
        self.arriving: dict[tuple, tuple] = {}
        # NCCL's rules: each rank's operations in issue order, the operation of each position
        self.ops: list[list[_Comm]] = [[] for _ in self.streams]
        self.op_at: dict[tuple[int, int], _Comm] = {}
        self.send_side: dict[tuple, _Comm] = {}  # message key -> its send's operation
        self.recv_side: dict[tuple, _Comm] = {}  # message key -> its receive's operation

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for r in range(len(self.streams)):
                while self.pos[r] < len(self.streams[r]) and self._step(r):
                    moved = True
        stuck = [r for r in range(len(self.streams)) if self.pos[r] < len(self.streams[r])]
        if stuck:
            raise TpirError([self._stuck(r) for r in stuck])

    def _finish(self, r: int, start: float, end: float, wait: float, pred, arrival=None) -> None:
        i = self.pos[r]
        self.events[(r, i)] = Event(r, i, self.streams[r][i], start, end, wait, arrival)
        self.pred[(r, i)] = pred
        self.clock[r] = end
        self.pos[r] += 1

    def _previous(self, r: int) -> tuple[int, int] | None:
        return (r, self.pos[r] - 1) if self.pos[r] > 0 else None

    def _step(self, r: int) -> bool:
        """Run rank r's next instruction if it can run; False when it must wait."""
        instr = self.streams[r][self.pos[r]]
        t = self.clock[r]
        prev = self._previous(r)
        if self.nccl and instr.op in (Op.SEND, Op.RECV, Op.EXCHANGE, Op.STEP):
            return self._nccl_step(r, instr, t, prev)
        if instr.op in COMPUTE_OPS:
            start, pred = t, prev
            if self.arriving:
                used = [(r, (peer, r, msg)) for _, peer, msg in compute_messages(self.header, r, instr)[0]]
                got = [self.arriving.get(k) for k in used]
                if self.nccl:  # an exchange's operation: its end, once both sides have started
                    got = [None if g is None else self._arrival(g) for g in got]
                    if any(g is False for g in got):
                        return False
                for k, g in zip(used, got):
                    self.arriving.pop(k, None)
                    if g is not None and g[0] > start:
                        start, pred = g
            self._finish(r, t, start + _compute_time(self.header, instr, self.costs), start - t, pred)
        elif instr.op is Op.EXCHANGE:
            self.exchange_end[r] = self.pos[r] + 1 + instr.count
            self._finish(r, t, t, 0.0, prev)
        elif instr.op is Op.SEND:
            self.sent.setdefault(message_key(r, instr), deque()).append((r, self.pos[r], t))
            self._finish(r, t, t, 0.0, prev)
        elif instr.op is Op.RECV:
            queue = self.sent.get(message_key(r, instr))
            if not queue:
                return False
            src, index, sent_at = queue.popleft()
            l, _, size = slice_extent(self.header, instr)
            arrival = sent_at + self.costs.p2p_time(self.costs.activation_bytes(l, size))
            if self.pos[r] < self.exchange_end[r]:  # waited for where it is used
                self.arriving[(r, message_key(r, instr))] = (arrival, (src, index))
                self._finish(r, t, t, 0.0, prev, arrival)
            elif arrival > t:
                self._finish(r, t, arrival, arrival - t, (src, index))
            else:
                self._finish(r, t, t, 0.0, prev)
        elif instr.op is Op.REDUCE_TIED:
            return self._collective(r, instr.tie, _tie_ranks(self.header, r, instr),
                                    self.costs.tied_bytes(instr.tie))
        elif instr.op is Op.REDUCE_REPLICAS:
            # a tied parameter is summed by its reduce-tied, not here (docs/ir.md, W1)
            tied = sum(self.costs.tied_bytes(t.name) for t in self.header.ties if instr.stage in t.stages)
            return self._collective(r, replica_group(instr.stage), self.header.stage_ranks(instr.stage),
                                    max(0.0, self.costs.param_bytes(instr.stage) - tied))
        elif instr.op is Op.ALLREDUCE:
            cost = self.costs.grad_sync_time(instr.stage, self.header.mesh.data)
            self._finish(r, t, t + cost, 0.0, prev)
        elif instr.op is Op.REDUCE_LOSS:  # one float64 summed over the replicas
            cost = self.costs.allreduce_time(8.0, self.header.mesh.data)
            self._finish(r, t, t + cost, 0.0, prev)
        else:  # load, free-kv, step: bookkeeping the cost models do not time
            self._finish(r, t, t, 0.0, prev)
        return True

    # ------------------------------------------------------------------ NCCL's rules

    def _transfer(self, r: int, instr: Instr) -> float:
        l, _, size = slice_extent(self.header, instr)
        return self.costs.p2p_time(self.costs.activation_bytes(l, size))

    def _issue(self, r: int, positions, t: float) -> "_Comm":
        """Rank r issues one operation at time t: the sends and receives at `positions`."""
        op = _Comm(r, t, self.ops[r][-1] if self.ops[r] else None)
        for p in positions:
            instr = self.streams[r][p]
            key = message_key(r, instr)
            op.members.append((key, instr.op is Op.SEND, self._transfer(r, instr), p))
            (self.send_side if instr.op is Op.SEND else self.recv_side)[key] = op
            self.op_at[(r, p)] = op
        self.ops[r].append(op)
        return op

    def _start(self, op: "_Comm", busy: set) -> float | None:
        """When the operation starts: when issued, and not before its rank's previous one ended."""
        if op.prev is None:
            return op.issued
        end = self._end(op.prev, busy)
        return None if end is None else max(op.issued, end[0])

    def _end(self, op: "_Comm", busy: set | None = None):
        """(end, (rank, position) of the send that ended last) of an operation, or None while a
        partner has not issued its side (or waits, through its stream, on this one). The
        operations of a rank before it are resolved first, in order, without recursion (a rank
        may issue hundreds of sends nobody has asked the end of yet)."""
        if op.end is not None:
            return op.end
        busy = set() if busy is None else busy
        chain = []
        o = op
        while o is not None and o.end is None:
            chain.append(o)
            o = o.prev
        for o in reversed(chain):
            if self._resolve(o, busy) is None:
                return None
        return op.end

    def _resolve(self, op: "_Comm", busy: set):
        """The end of `op`, whose previous operation has ended (see `_end`)."""
        if id(op) in busy:
            return None
        busy.add(id(op))
        try:
            start = self._start(op, busy)
            if start is None:
                return None
            end, last = start, None
            for key, is_send, transfer, p in op.members:
                other = (self.recv_side if is_send else self.send_side).get(key)
                if other is None:
                    return None
                other_start = self._start(other, busy)
                if other_start is None:
                    return None
                done = max(start, other_start) + transfer
                if done >= end:
                    send_pos = p if is_send else next(q for k, _, _, q in other.members if k == key)
                    end, last = done, ((op.rank if is_send else other.rank), send_pos)
            op.end = (end, last)
            return op.end
        finally:
            busy.discard(id(op))

    def _arrival(self, got):
        """An exchange receive's arrival: (time, the send's event), False while unknown."""
        if not isinstance(got, _Comm):
            return got
        end = self._end(got)
        return False if end is None else end

    def _nccl_step(self, r: int, instr: Instr, t: float, prev) -> bool:
        pos = self.pos[r]
        if instr.op is Op.EXCHANGE:
            span = exchange_span(self.streams[r], pos)
            self.exchange_end[r] = span.stop
            self._issue(r, [p for p in span if self.streams[r][p].op in (Op.SEND, Op.RECV)], t)
            self._finish(r, t, t, 0.0, prev)
            return True
        if instr.op is Op.STEP:  # the executor's flush: every send of the rank has ended
            ends = [self._end(op) for op in self.ops[r]]
            if any(e is None for e in ends):
                return False
            ready = max([t] + [e[0] for e in ends])
            self._finish(r, t, ready, ready - t, prev)
            return True
        op = self.op_at.get((r, pos)) or self._issue(r, [pos], t)
        if instr.op is Op.SEND:
            self._finish(r, t, t, 0.0, prev)
            return True
        key = message_key(r, instr)
        if pos < self.exchange_end[r]:  # an exchange's receive: waited for where it is used
            self.arriving[(r, key)] = op
            self._finish(r, t, t, 0.0, prev)
            return True
        end = self._end(op)
        if end is None:
            return False
        arrival, sender = end
        if arrival > t:
            self._finish(r, t, arrival, arrival - t, sender, arrival)
        else:
            self._finish(r, t, t, 0.0, prev, arrival)
        return True

    def _collective(self, r: int, group, ranks, nbytes: float) -> bool:
        """A reduce-tied (group: the tie's name) or reduce-replicas (`replica_group(S)`) on rank
        r: it starts when every rank of `ranks` has reached its k-th instance, then costs an
        all-reduce of `nbytes` over them."""
        k = self.tie_seen.get((r, group), 0)
        arrivals = self.tie_arrivals.setdefault((group, k), {})
        arrivals.setdefault(r, (self.clock[r], self.pos[r]))
        if any(q not in arrivals for q in ranks):
            return False
        ready, last = max((arrivals[q][0], q) for q in ranks)
        cost = self.costs.allreduce_time(nbytes, len(ranks))
        t = self.clock[r]
        last_index = arrivals[last][1]
        pred = self._previous(r) if (last == r or ready <= t) else (
            (last, last_index - 1) if last_index > 0 else None
        )
        self.tie_seen[(r, group)] = k + 1
        self._finish(r, t, ready + cost, ready - t, pred)
        return True

    def _stuck(self, r: int) -> Diagnostic:
        instr = self.streams[r][self.pos[r]]
        if self.nccl and instr.op not in (Op.REDUCE_TIED, Op.REDUCE_REPLICAS):
            why = ("under NCCL's rules its sends and receives wait, in issue order, on operations "
                   "that wait on it")
            hint = "run `tpc verify --comm nccl` on the plan: it says where the ranks wait on each other"
        elif instr.op is Op.RECV:
            why = f"no rank sends what it receives (rank {instr.peer} never runs the matching send)"
            hint = (f"rank {instr.peer} must run `send {instr.payload.value} ...` of this message "
                    "before it waits on anything that depends on this rank")
        else:
            group = instr.tie if instr.op is Op.REDUCE_TIED else replica_group(instr.stage)
            ranks = (_tie_ranks(self.header, r, instr) if instr.op is Op.REDUCE_TIED
                     else self.header.stage_ranks(instr.stage))
            k = self.tie_seen.get((r, group), 0)
            arrived = self.tie_arrivals.get((group, k), {})
            missing = [q for q in ranks if q not in arrived]
            why = f"waits for rank(s) {', '.join(map(str, missing))} to reach `{instr}`"
            hint = ("every rank holding the tie or the stage's replicas must reach it; run "
                    "`tpc verify` to find the cycle")
        return Diagnostic(
            f"deadlock: rank {r} is stuck at instruction {self.pos[r]} `{instr}`: {why}",
            loc=instr.loc,
            where=f"rank {r}",
            hint=hint,
        )

    def critical_path(self) -> tuple[Event, ...]:
        if not self.events:
            return ()
        key = max(self.events, key=lambda k: (self.events[k].end, -k[0], k[1]))
        path = []
        while key is not None:
            path.append(self.events[key])
            key = self.pred[key]
        return tuple(reversed(path))


def simulate(plan: Plan, costs: CostModel, comm: CommRules = DEFAULT_COMM,
             shard_optimizer: bool = False) -> SimResult:
    """Predict the plan's timeline under `costs` and the rules of `comm` (gloo's buffered
    sends, or NCCL's rendezvous; see the module docstring). `shard_optimizer`: the memory of a
    run with `--shard-optimizer` (the optimizer state divided over the data-parallel group;
    the reduce-scatter and all-gather move what the allreduce moves, so the time is the same)."""
    sim = _Sim(plan, costs, comm)
    sim.run()
    events = tuple(sim.events[k] for k in sorted(sim.events))
    total = max((e.end for e in events), default=0.0)
    ranks = []
    for p in plan.ranks:
        mine = [e for e in events if e.rank == p.rank]
        busy = math.fsum(e.work for e in mine)
        compute = math.fsum(e.work for e in mine if e.instr.op in COMPUTE_OPS)
        idle = total - busy
        memory = rank_memory(plan.header, p.rank, p.instrs, costs, forward_only=plan.forward_only,
                             recv_ahead=RecvAhead.COMPUTES if comm == GLOO else 0,
                             optimizer_shards=plan.header.mesh.data if shard_optimizer else 1)
        ranks.append(
            RankStats(p.rank, busy, compute, idle, idle / total if total > 0 else 0.0, memory.peak)
        )
    return SimResult(
        plan=plan,
        iteration_time=total,
        events=events,
        ranks=tuple(ranks),
        critical_path=sim.critical_path(),
        time_unit=costs.time_unit,
        memory_unit=costs.memory_unit,
        shard_optimizer=shard_optimizer and plan.header.mesh.data > 1,
    )
