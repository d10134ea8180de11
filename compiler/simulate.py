"""Discrete-event simulation of a plan: predicted timeline, bubble, critical path and memory.

`simulate(plan, costs)` runs every rank's stream under a cost model and honours every ordering
rule of docs/ir.md:

* program order: a rank runs one instruction at a time, in the order written;
* a `send` never blocks and takes no time on the sender (it is buffered; the transfer runs on
  the link); its `recv` ends at max(when the receiver reaches it, when the send ran + the
  transfer time `p2p_time(activation_bytes(l, mb_size))`). Messages between two ranks are
  matched by what they carry (payload, the stage boundary crossed, micro-batch, slice), first
  sent first received;
* `reduce-tied NAME` starts when every rank holding a stage of the tie has reached it (the
  k-th `reduce-tied NAME` of each rank together), then costs an all-reduce of the tied bytes
  over those ranks;
* `allreduce stage S` costs the cost model's `grad_sync_time(S, data)`, or an all-reduce of
  stage S's gradients (`param_bytes(S)`) over the data-parallel replicas (they run identical
  streams, so nobody waits for anybody);
* compute costs `slice_time(stage, l, c, mb_size)`: forward and recompute the first number,
  backward the second. A split backward's `backward-input` and `backward-weight` cost the
  cost model's `split_backward_time(stage, l, c, mb_size)` -> (t_input, t_weight) where it has
  one (the profiled model: both halves measured by `tpc profile`; they are uneven and together
  cost more than a plain backward); under a model without it (unit costs, the analytic and
  graph device models) each costs half the backward.

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
from typing import Protocol

from tpc.compiler.memory import Memory, rank_memory, slice_extent
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import COMPUTE_OPS, Header, Instr, Op, Payload, Plan

# ---------------------------------------------------------------------------- cost models


class CostModel(Protocol):
    """What the simulator asks of a cost model (tpc.compiler.costmodel implements it).

    Optional extras, used when present: `stash_bytes(stage, l, c, mb_size)` (what a forward
    keeps for its backward; else `activation_bytes`), `split_backward_time(stage, l, c,
    mb_size)` -> (backward-input, backward-weight) (else half the backward each),
    `grad_sync_time(stage, data)` and
    `allreduce_time(nbytes, n)` (else a ring all-reduce made of `p2p_time` steps),
    `tied_bytes(name)` (else 0: the tied gradient is taken as small), `time_unit` ("s" unless
    said) and `memory_unit` ("B" unless said).
    """

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]: ...

    def p2p_time(self, nbytes: float) -> float: ...

    def activation_bytes(self, l: int, mb_size: int) -> float: ...

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> float: ...

    def param_bytes(self, stage: int) -> float: ...


@dataclass(frozen=True)
class UnitCosts:
    """The textbook cost model: forward 1, backward 2 per slice, free communication.

    With `ref_len` set, a slice of length l costs l / ref_len forwards (so slices of unequal
    length cost in proportion; `for_plan` sets it to the plan's mean slice length, so an
    average slice still costs 1). Memory is counted in slice activations: each live slice
    graph is `activation_bytes` (1, or l / ref_len), parameters and KV caches count 0.
    `p2p` is the time of every transfer (0 by default).
    """

    forward: float = 1.0
    backward: float = 2.0
    ref_len: float | None = None
    p2p: float = 0.0
    time_unit: str = "unit"
    memory_unit: str = "act"

    @classmethod
    def for_plan(cls, header: Header, **kw) -> "UnitCosts":
        """Unit costs scaled by slice length, an average slice of the plan costing 1."""
        n = sum(len(m.slices) for m in header.microbatches)
        return cls(ref_len=header.shape.seq * len(header.microbatches) / max(n, 1), **kw)

    def _scale(self, l: int) -> float:
        return 1.0 if self.ref_len is None else l / self.ref_len

    def slice_time(self, stage: int, l: int, c: int, mb_size: int) -> tuple[float, float]:
        return self.forward * self._scale(l), self.backward * self._scale(l)

    def p2p_time(self, nbytes: float) -> float:
        return self.p2p

    def activation_bytes(self, l: int, mb_size: int) -> float:
        return self._scale(l)

    def kv_bytes(self, stage: int, l: int, mb_size: int) -> float:
        return 0.0

    def param_bytes(self, stage: int) -> float:
        return 0.0

    def describe(self) -> str:
        scaled = ", scaled by slice length" if self.ref_len is not None else ""
        return f"unit costs (forward {self.forward:g}, backward {self.backward:g} per slice{scaled})"


def allreduce_time(costs: CostModel, nbytes: float, n: int) -> float:
    """Time to sum `nbytes` over `n` ranks: the model's own, or a ring (2(n-1) steps of
    nbytes/n each, the bandwidth-optimal algorithm NCCL and gloo use for large tensors)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    own = getattr(costs, "allreduce_time", None)
    if own is not None:
        return own(nbytes, n)
    return 2 * (n - 1) * costs.p2p_time(nbytes / n)


def grad_sync_time(costs: CostModel, stage: int, data: int) -> float:
    """Time to sum a stage's gradients over `data` replicas: the model's own, or a ring."""
    own = getattr(costs, "grad_sync_time", None)
    if own is not None:
        return own(stage, data)
    return allreduce_time(costs, costs.param_bytes(stage), data)


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

    def events_of(self, rank: int) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.rank == rank)

    @property
    def bubble(self) -> float:
        """Mean bubble fraction over the ranks."""
        return statistics.fmean(r.bubble for r in self.ranks) if self.ranks else 0.0


# ------------------------------------------------------------------------------- simulation


def _boundary(instr: Instr) -> int:
    """The stage boundary a message crosses: b is the edge between stage b and stage b+1."""
    forward_going = instr.payload is Payload.ACT
    sending = instr.op is Op.SEND
    # send act S crosses S; recv act S crosses S-1; send grad S crosses S-1; recv grad S crosses S
    return instr.stage if forward_going == sending else instr.stage - 1


def message_key(rank: int, instr: Instr) -> tuple:
    src, dst = (rank, instr.peer) if instr.op is Op.SEND else (instr.peer, rank)
    return (src, dst, instr.payload, _boundary(instr), instr.mb, instr.slice)


def _compute_time(header: Header, instr: Instr, costs: CostModel) -> float:
    l, c, size = slice_extent(header, instr)
    if instr.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
        split = getattr(costs, "split_backward_time", None)
        if split is not None:
            t_input, t_weight = split(instr.stage, l, c, size)
            return t_input if instr.op is Op.BACKWARD_INPUT else t_weight
        return costs.slice_time(instr.stage, l, c, size)[1] / 2
    t_fwd, t_bwd = costs.slice_time(instr.stage, l, c, size)
    return t_fwd if instr.op in (Op.FORWARD, Op.RECOMPUTE) else t_bwd


def _tie_ranks(header: Header, rank: int, instr: Instr) -> tuple[int, ...]:
    for tie in header.ties:
        if tie.name == instr.tie:
            return tuple(sorted({header.stage_rank(s) for s in tie.stages}))
    raise TpirError(
        Diagnostic(
            f"rank {rank} reduces tie {instr.tie!r}, which the header does not declare",
            loc=instr.loc,
            where=f"rank {rank}: `{instr}`",
            hint="declare it with a `tie` line, or run `tpc verify` first",
        )
    )


class _Sim:
    """The state of one simulation; `run` advances every rank as far as its dependencies let
    it, round after round, until all are done or none can move (a deadlock)."""

    def __init__(self, plan: Plan, costs: CostModel):
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

    def _finish(self, r: int, start: float, end: float, wait: float, pred) -> None:
        i = self.pos[r]
        self.events[(r, i)] = Event(r, i, self.streams[r][i], start, end, wait)
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
        if instr.op in COMPUTE_OPS:
            self._finish(r, t, t + _compute_time(self.header, instr, self.costs), 0.0, prev)
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
            if arrival > t:
                self._finish(r, t, arrival, arrival - t, (src, index))
            else:
                self._finish(r, t, t, 0.0, prev)
        elif instr.op is Op.REDUCE_TIED:
            return self._reduce_tied(r, instr)
        elif instr.op is Op.ALLREDUCE:
            cost = grad_sync_time(self.costs, instr.stage, self.header.mesh.data)
            self._finish(r, t, t + cost, 0.0, prev)
        else:  # load, free-kv, step: bookkeeping the cost models do not time
            self._finish(r, t, t, 0.0, prev)
        return True

    def _reduce_tied(self, r: int, instr: Instr) -> bool:
        ranks = _tie_ranks(self.header, r, instr)
        k = self.tie_seen.get((r, instr.tie), 0)
        arrivals = self.tie_arrivals.setdefault((instr.tie, k), {})
        arrivals.setdefault(r, (self.clock[r], self.pos[r]))
        if any(q not in arrivals for q in ranks):
            return False
        ready, last = max((arrivals[q][0], q) for q in ranks)
        nbytes = getattr(self.costs, "tied_bytes", lambda name: 0.0)(instr.tie)
        cost = allreduce_time(self.costs, nbytes, len(ranks))
        t = self.clock[r]
        last_index = arrivals[last][1]
        pred = self._previous(r) if (last == r or ready <= t) else (
            (last, last_index - 1) if last_index > 0 else None
        )
        self.tie_seen[(r, instr.tie)] = k + 1
        self._finish(r, t, ready + cost, ready - t, pred)
        return True

    def _stuck(self, r: int) -> Diagnostic:
        instr = self.streams[r][self.pos[r]]
        if instr.op is Op.RECV:
            why = f"no rank sends what it receives (rank {instr.peer} never runs the matching send)"
            hint = (f"rank {instr.peer} must run `send {instr.payload.value} ...` of this message "
                    "before it waits on anything that depends on this rank")
        else:
            k = self.tie_seen.get((r, instr.tie), 0)
            arrived = self.tie_arrivals.get((instr.tie, k), {})
            missing = [q for q in _tie_ranks(self.header, r, instr) if q not in arrived]
            why = f"waits for rank(s) {', '.join(map(str, missing))} to reduce {instr.tie!r}"
            hint = "every rank holding the tie must reach its reduce-tied; run `tpc verify` to find the cycle"
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


def simulate(plan: Plan, costs: CostModel) -> SimResult:
    """Predict the plan's timeline under `costs` (see the module docstring)."""
    sim = _Sim(plan, costs)
    sim.run()
    events = tuple(sim.events[k] for k in sorted(sim.events))
    total = max((e.end for e in events), default=0.0)
    ranks = []
    for p in plan.ranks:
        mine = [e for e in events if e.rank == p.rank]
        busy = math.fsum(e.work for e in mine)
        compute = math.fsum(e.work for e in mine if e.instr.op in COMPUTE_OPS)
        idle = total - busy
        memory = rank_memory(plan.header, p.rank, p.instrs, costs)
        ranks.append(
            RankStats(p.rank, busy, compute, idle, idle / total if total > 0 else 0.0, memory.peak)
        )
    return SimResult(
        plan=plan,
        iteration_time=total,
        events=events,
        ranks=tuple(ranks),
        critical_path=sim.critical_path(),
        time_unit=getattr(costs, "time_unit", "s"),
        memory_unit=getattr(costs, "memory_unit", "B"),
    )


# ------------------------------------------------------------------------------------- CLI


def load_costs(args, header: Header) -> CostModel:
    """The cost model the options name: --unit (the default) or the cost-model package's
    loader for --cost / --device-model."""
    if not getattr(args, "cost", None) and not getattr(args, "device_model", None):
        return UnitCosts.for_plan(header)
    from tpc.compiler.costmodel import load_cost_model

    ranges = [stage.units for stage in header.stages]
    if args.cost:
        return load_cost_model(cost=args.cost, stage_units=ranges, num_units=header.units.count,
                               model_sha256=header.model.sha256)
    # the device model prices the traced graph: build and trace the model the plan names
    from tpc.compiler.frontend import SlicedModel, load_model

    model = load_model(header.model.path, header.model.factory)
    sliced = SlicedModel.from_model(model, seq_len=header.shape.seq, vocab=header.shape.vocab)
    if sliced.num_units != header.units.count:
        raise TpirError(Diagnostic(
            f"the plan has {header.units.count} units, {header.model.path} traces to {sliced.num_units}",
            where="--device-model", hint="recompile the plan from the current model file"))
    return load_cost_model(device_model=args.device_model, sliced=sliced, stage_units=ranges)


def format_quantity(value: float, unit: str) -> str:
    """Bytes in binary units, seconds in ms, anything else as a plain number and its unit."""
    if unit == "B":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.2f} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "unit":
        return f"{value:.4g} unit{'s' if value != 1 else ''}"
    return f"{value:.4g} {unit}"


def critical_path_summary(result: SimResult) -> str:
    """Where the iteration time goes: the ranks the critical path crosses, and how much of it
    is compute, other work and waiting for messages."""
    path = result.critical_path
    if not path:
        return "critical path: empty plan"
    hops = [path[0].rank]
    for e in path[1:]:
        if e.rank != hops[-1]:
            hops.append(e.rank)
    compute = math.fsum(e.work for e in path if e.instr.op in COMPUTE_OPS)
    other = math.fsum(e.work for e in path if e.instr.op not in COMPUTE_OPS)
    gaps = result.iteration_time - compute - other
    n_compute = sum(1 for e in path if e.instr.op in COMPUTE_OPS)
    u = result.time_unit
    return (
        f"critical path: {n_compute} compute instructions over ranks "
        f"{' > '.join(map(str, hops))}\n"
        f"  compute {format_quantity(compute, u)}, communication and other work "
        f"{format_quantity(other, u)}, transfers {format_quantity(gaps, u)}\n"
        f"  from `{path[0].instr}` (rank {path[0].rank}) to `{path[-1].instr}` (rank {path[-1].rank})"
    )


def format_report(result: SimResult, name: str, costs_text: str) -> str:
    """The table `tpc simulate` prints."""
    h = result.plan.header
    from tpc.compiler.timeline import slices_summary

    M = len(h.microbatches)
    t, m = result.time_unit, result.memory_unit
    lines = [
        f"{name}: schedule {h.schedule.name!r}, {h.num_stages} stages on {h.mesh.pipe} ranks, "
        f"{M} micro-batch{'es' if M != 1 else ''}, {slices_summary(h)}; {costs_text}",
        "",
        f"{'rank':>4}  {'busy':>14}  {'idle':>14}  {'bubble':>7}  {'peak memory':>14}",
    ]
    for r in result.ranks:
        lines.append(
            f"{r.rank:>4}  {format_quantity(r.busy, t):>14}  {format_quantity(r.idle, t):>14}  "
            f"{r.bubble:>7.1%}  {format_quantity(r.peak_memory.total, m):>14}"
        )
    lines += [
        "",
        f"iteration time: {format_quantity(result.iteration_time, t)}   "
        f"mean bubble: {result.bubble:.1%}",
        critical_path_summary(result),
    ]
    if m == "act":
        lines.append("memory in slice activations (graphs kept from a forward to its backward)")
    return "\n".join(lines)


def _writing(option: str, path: str, write) -> None:
    """Run `write`; a file that cannot be written is the user's error, not a traceback."""
    try:
        write()
    except OSError as e:
        raise TpirError(Diagnostic(
            f"cannot write {path}: {e.strerror or e}",
            where=option,
            hint="give a path in a folder that exists and that you may write to",
        )) from None


def simulate_from_cli(args) -> int:
    """`tpc simulate PLAN [--cost F | --device-model N | --unit] [--trace J] [--png P]
    [--compare M]`: verify, simulate, print the table, write what was asked."""
    from tpc.compiler import timeline
    from tpc.compiler.torch_schedule.load import load_checked_plan

    plan = load_checked_plan(args.plan, needs_model=bool(getattr(args, "cost", None) or getattr(args, "device_model", None)))
    costs = load_costs(args, plan.header)
    result = simulate(plan, costs)
    describe = getattr(costs, "describe", None)
    print(format_report(result, args.plan, describe() if describe else type(costs).__name__))
    if getattr(args, "trace", None):
        _writing("--trace", args.trace, lambda: timeline.write_trace(result, args.trace, args.plan))
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev)")
    if getattr(args, "png", None):
        _writing("--png", args.png, lambda: timeline.write_gantt(result, args.png))
        print(f"timeline: {args.png}")
    if getattr(args, "compare", None):
        comparison = timeline.compare(result, timeline.read_trace(args.compare))
        print(f"\npredicted vs measured ({args.compare}):")
        print(timeline.format_comparison(comparison))
    return 0
