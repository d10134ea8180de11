"""List scheduling: a rank's order read off a simulated run of the pipeline.

Some schedules are rules about *when* a rank runs its next forward, backward or weight gradient
rather than a fixed pattern: run the backward as soon as its gradient is there, else a forward
while memory allows, else a deferred weight gradient to fill the wait (Zero Bubble's rules).
Where those rules meet token slices (a slice's backward waits for the next slice's, a micro-batch
holds several slices) a closed formula for each rank's order is hard to state, and easy to get
wrong. So the order is computed: every rank is simulated under token-proportional unit costs, and
each rank's compute order is the order in which the simulation ran its jobs.

Jobs. The work is cut into units: a unit is a list of (micro-batch, slice) pairs of one
micro-batch that run back to back (a whole micro-batch, or one slice). On each stage a unit has
a forward job (its slices in token order), a backward job (its slices in reverse token order;
`backward-input` when split) and, when split, a weight job (`backward-weight` of its slices,
in the backward's order). A job costs its tokens: forward 1 per token, backward 2 (1 for each
half of a split backward), so the simulation sees F = B = W for a split backward.

A job may start when every job it depends on has finished (DESIGN.md section 4):
  forward  (s, u)  the forwards of stage s-1 holding u's slices, and of stage s holding the
                   slices before u's first in its micro-batch (the KV cache);
  backward (s, u)  the forward (s, u), the backwards of stage s+1 holding u's slices, and of
                   stage s holding the slices after u's last (the gradients sent into u's keys
                   and values);
  weight   (s, u)  the backward (s, u).

Rules. Each rank has a forward sequence and a backward sequence (fixed orders of jobs, see
`sequences`); weight jobs queue in the order their backwards ran. A rank runs:
  warm-up  its first `warmup(r)` forwards, each as soon as it may start;
  steady   alternately one forward and one backward (1F1B), starting with a forward. A forward
           runs only while the rank holds fewer than `limit(r)` forwards' activations (a
           forward holds them until its backward, or until its weight job when split); while
           the job it wants may not start, or the limit holds the forward back, the rank runs
           its oldest queued weight job (Zero Bubble's "W fills the bubble"; at the limit it is
           also what frees memory), else it waits;
  cool-down once every forward has run: each backward when it may start, weight jobs while
           it waits, then the remaining weight jobs.
A rank waits only for a job to finish somewhere. When no job is running anywhere and no rank
can start one by these rules, the lowest rank that has a forward or backward that may start
runs it regardless of the alternation and the limit, so the simulation always runs to the end
(below). With the schedules' warm-ups this happens only on a few sliced interleaved shapes whose
blocks of units straddle micro-batches (e.g. 3 ranks, 2 chunks, 8 slices); it costs a little
bubble there, never correctness, and it makes any warm-up and limit safe.

`build` sets the warm-up from the sequences: `first_need(r)` is how many forwards of its
sequence rank r runs before its first backward can start at all (the forward of the same stage
and unit: with token slices, every slice of the first micro-batch; with several chunks, up to
the last chunk's); the warm-up is first_need(r) - 1 plus a schedule's `extra(r)`, the 1F1B
term p - 1 - r (or Megatron's 2(p - 1 - r) for interleaved chunks), and the limit is
first_need(r) - 1 plus a schedule's `hold(r)`.

Why the result cannot deadlock. Every job in the simulation started after every job it needs
had finished, so the simulated run is a valid execution of the whole step; each rank's order is
that execution's projection, and the lowering pass keeps a valid execution valid (receives
before the compute that needs them, sends in the order the receiver takes them). And the
simulation always runs to the end: `sequences` gives each rank its forwards in the order of the
key (block, stage, unit), which is a topological order of the forward dependencies (a forward
needs a lower stage of its unit, or an earlier unit of its stage), and its backwards in the order
of (block, -stage, backward unit), one of the backward dependencies. So the not yet run forward
that is first by the key is the next forward of its rank and may start; once every forward has
run, the same holds for the first backward by its key. Whatever the placement of the stages,
some job can always start when nothing runs (relaxing `limit` if that is what holds it).

Ties in time are broken by rank, then by the rules above, so the order is deterministic.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tpc.compiler.schedules.common import Compute, empty
from tpc.compiler.schedules.placement import chunks
from tpc.ir.nodes import Header, Instr, Op

Unit = tuple[tuple[int, int], ...]  # (micro-batch, slice) pairs of one micro-batch, in token order
Job = tuple[str, int, int]  # (kind "F"|"B"|"W", stage, unit index)


def microbatch_units(header: Header) -> list[Unit]:
    """One unit per micro-batch: all its slices."""
    return [tuple((m, i) for i in range(len(mb.slices))) for m, mb in enumerate(header.microbatches)]


def slice_units(header: Header) -> list[Unit]:
    """One unit per (micro-batch, slice), in forward order."""
    return [((m, i),) for m, mb in enumerate(header.microbatches) for i in range(len(mb.slices))]


def backward_order(units: Sequence[Unit]) -> list[int]:
    """Unit indices in backward order: micro-batch by micro-batch, later slices first."""
    return sorted(range(len(units)), key=lambda k: (units[k][0][0], -units[k][0][1]))


def sequences(header: Header, units: Sequence[Unit], block: int | None = None):
    """Each rank's forward and backward sequences, Megatron's interleaved order: units go in
    blocks of `block` (default: the pipeline ranks); for each block, the rank's chunks in
    pipeline order run its units forward; backward, the blocks of units in backward order run
    through the chunks in reverse. With one chunk per rank: plainly forward order and backward
    order. Any placement: the orders are the keys (block, stage, unit) and (block, -stage,
    backward unit) of the module docstring. Returns (forwards, backwards): rank -> list of
    (stage, unit index)."""
    g = block or header.mesh.pipe
    fwd_units = list(range(len(units)))
    bwd_units = backward_order(units)
    forwards, backwards = {}, {}
    for r in range(header.mesh.pipe):
        mine = chunks(header, r)
        forwards[r] = [(s, u) for b in range(0, len(units), g) for s in mine for u in fwd_units[b:b + g]]
        backwards[r] = [(s, u) for b in range(0, len(units), g) for s in reversed(mine)
                        for u in bwd_units[b:b + g]]
    return forwards, backwards


@dataclass
class _Rank:
    forwards: list
    backwards: list
    limit: int
    f: int = 0  # next forward
    b: int = 0  # next backward
    weights: deque = field(default_factory=deque)
    holding: int = 0  # forwards whose activations are held
    warmup: int = 0
    want: str = "F"  # after the warm-up: what the steady state runs next
    free_at: int = 0
    order: list = field(default_factory=list)


def list_schedule(header: Header, units: Sequence[Unit], forwards: dict, backwards: dict, *,
                  split: bool, warmup: Callable[[int], int], limit: Callable[[int], int]) -> Compute:
    """Each rank's compute order by the rules of the module docstring. `forwards[r]` and
    `backwards[r]` list (stage, unit index) of rank r's stages; `warmup(r)` is how many forwards
    rank r runs before its steady state, `limit(r)` how many it may hold at once."""
    K = header.num_stages
    lengths = [mb.lengths for mb in header.microbatches]
    holder: dict[tuple[int, int], int] = {}  # (mb, slice) -> unit index
    for k, unit in enumerate(units):
        for ms in unit:
            holder[ms] = k
    tokens = [sum(lengths[m][i] for m, i in unit) for unit in units]

    def needs(job: Job) -> list[Job]:
        kind, s, k = job
        unit = units[k]
        out: list[Job] = []
        if kind == "F":
            if s > 0:
                out += [("F", s - 1, holder[ms]) for ms in unit]
            m, first = unit[0]
            if first > 0:
                out.append(("F", s, holder[(m, first - 1)]))
        elif kind == "B":
            out.append(("F", s, k))
            if s < K - 1:
                out += [("B", s + 1, holder[ms]) for ms in unit]
            m, last = unit[-1]
            if last + 1 < len(lengths[m]):
                out.append(("B", s, holder[(m, last + 1)]))
        else:
            out.append(("B", s, k))
        return out

    def cost(job: Job) -> int:
        kind, _, k = job
        return tokens[k] * (2 if kind == "B" and not split else 1)

    ranks = {r: _Rank([("F", s, k) for s, k in forwards[r]], [("B", s, k) for s, k in backwards[r]],
                      max(1, limit(r)), warmup=warmup(r)) for r in range(header.mesh.pipe)}
    finished: dict[Job, int] = {}
    total = sum(len(st.forwards) + len(st.backwards) * (2 if split else 1) for st in ranks.values())
    ends: list[int] = []  # finish times of running jobs (a heap)
    now, ran = 0, 0

    def ready(job: Job) -> bool:
        return all(finished.get(n, now + 1) <= now for n in needs(job))

    def start(r: int, st: _Rank, job: Job) -> None:
        nonlocal ran
        end = now + cost(job)
        finished[job] = end
        st.free_at = end
        st.order.append(job)
        heapq.heappush(ends, end)
        ran += 1

    def take_backward(st: _Rank) -> Job:
        job = st.backwards[st.b]
        st.b += 1
        if split:
            st.weights.append(("W", job[1], job[2]))
        else:
            st.holding -= 1
        st.want = "F"
        return job

    def take_forward(st: _Rank) -> Job:
        job = st.forwards[st.f]
        st.f += 1
        st.holding += 1
        st.want = "B"
        return job

    def take_weight(st: _Rank) -> Job:
        st.holding -= 1
        return st.weights.popleft()

    def pick(st: _Rank, relax: bool = False) -> Job | None:
        b_ok = st.b < len(st.backwards) and ready(st.backwards[st.b])
        f_ok = st.f < len(st.forwards) and ready(st.forwards[st.f])
        if relax:
            return take_backward(st) if b_ok else take_forward(st) if f_ok else None
        if st.f < min(st.warmup, len(st.forwards)) and st.b == 0:  # warm-up: forwards only
            if not f_ok:
                return None
            job = take_forward(st)
            st.want = "F"  # the steady state starts with a forward
            return job
        if st.want == "F" and st.f < len(st.forwards):
            if f_ok and st.holding < st.limit:
                return take_forward(st)
        elif b_ok:
            return take_backward(st)
        return take_weight(st) if st.weights else None

    while ran < total:
        for r, st in ranks.items():
            if st.free_at <= now:
                job = pick(st)
                if job is not None:
                    start(r, st, job)
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        if ends:
            now = ends[0]
            continue
        if ran == total:
            break
        # nothing runs and nothing can start: only a memory limit holds a forward back
        for r, st in ranks.items():
            job = pick(st, relax=True)
            if job is not None:
                start(r, st, job)
                break
        else:  # pragma: no cover - the sequences are consistent (module docstring)
            raise RuntimeError("list scheduling is stuck: the job sequences are inconsistent")

    out = empty(header)
    for r, st in ranks.items():
        out[r] = [ins for job in st.order for ins in _instrs(job, units[job[2]], split)]
    return out


def _instrs(job: Job, unit: Unit, split: bool) -> list[Instr]:
    kind, s, _ = job
    if kind == "F":
        return [Instr(Op.FORWARD, stage=s, mb=m, slice=i) for m, i in unit]
    op = Op.BACKWARD_WEIGHT if kind == "W" else (Op.BACKWARD_INPUT if split else Op.BACKWARD)
    return [Instr(op, stage=s, mb=m, slice=i) for m, i in reversed(unit)]


def first_need(header: Header, forwards: dict, backwards: dict, rank: int) -> int:
    """How many forwards of its sequence rank `rank` must run before its first backward can:
    up to the forward of the same (stage, unit) (with token slices, the last slice of the
    first micro-batch; with several chunks, the last chunk's)."""
    if not backwards[rank]:
        return 0
    return forwards[rank].index(backwards[rank][0]) + 1


def build(header: Header, units: Sequence[Unit], *, split: bool, extra: Callable[[int], int],
          hold: Callable[[int], int], block: int | None = None) -> Compute:
    """`list_schedule` over `sequences(header, units, block)`, rank r with a warm-up of
    `first_need(r) - 1 + extra(r)` forwards and holding at most `first_need(r) - 1 + hold(r)`
    (never fewer than its warm-up and one more)."""
    forwards, backwards = sequences(header, units, block)
    need = {r: first_need(header, forwards, backwards, r) for r in forwards}
    warm = {r: max(0, need[r] - 1 + extra(r)) for r in forwards}
    cap = {r: max(warm[r] + 1, need[r] - 1 + hold(r)) for r in forwards}
    return list_schedule(header, units, forwards, backwards, split=split, warmup=warm.__getitem__,
                         limit=cap.__getitem__)
