"""Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with
Bidirectional Pipelines", SC'21): two pipelines in opposite directions over the same stages.

D stages on D ranks, each stage with two weight replicas (`stage S ranks S D-1-S`, format
version 3): the "down" pipeline (replica 0) runs stage s on rank s, the "up" pipeline (replica 1)
stage s on rank D-1-s. Micro-batch m runs on replica m mod 2 (`microbatch ... replica K`), so
every D consecutive micro-batches are one of Chimera's basic units, D/2 in each direction. Each
rank holds stage r of one pipeline and stage D-1-r of the other: its idle slots in one pipeline's
fill and drain are the other pipeline's work. The replicas' gradients are summed before the step
by `reduce-replicas stage S` (added by the lowering, `lower.insert_reduce_replicas`), which the
verifier checks and the simulator prices as an all-reduce of the stage's gradients.

The order. Each rank's order is read off a run of the whole step under unit costs (a forward
costs its slice's tokens, a backward twice that), in which every rank, whenever it is free, runs:
  1. the ready backward of the micro-batch that entered the pipelines first (1F1B: a backward
     frees activations and feeds the rank before it);
  2. else a ready forward, while the rank holds fewer than `D` micro-batches' activations
     (1F1B's first rank's peak, which Chimera keeps: its activation memory is between D/2 + 1
     and D micro-batches' per rank);
  3. else it waits for a job to finish somewhere.
A job is ready when every job it needs has finished (DESIGN.md section 4). Which forward a rank
picks has three rules (`FORWARD_RULES`): the micro-batch that entered first; the forward with the
longest chain of work from it to the end of the step (the critical path); or the next slice of
the earliest pair of micro-batches (one per direction), which keeps both pipelines fed when the
micro-batches are cut into token slices. The run is made under each rule with a backward costing
one and two forwards, and the order whose step is shortest under B = 2F is kept.

With D micro-batches this is Chimera's basic unit: under F = B (the paper's figures) a step
takes 2N + D - 2, a bubble of (D - 2)/(2N + D - 2) against 1F1B's
(D - 1)/(N + D - 1). With N = kD, the units follow one another (Chimera's "direct
concatenation"): the next unit's forwards start as soon as a rank has room for them, so under
F = B the bubbles at the end of one unit are filled and the step stays 2N + D - 2. Under B = 2F
the unit's bubbles grow and concatenated units leave bubbles in the middle; the step stays
shorter than 1F1B's up to N = 2D. The paper's remedy, forward doubling, is the schedule
`chimera-doubling` (compiler/schedules/chimera_doubling.py): `build_order(doubling=True)` runs
the same order-making with the forwards of two micro-batches of one pipeline as one job
(`forward_groups`) and twice the activation cap.

Token slices. The jobs are slices: forward (s, m, i) needs the forward of (s - 1, m, i) (its
input) and of (s, m, i - 1) (the key/value cache of the earlier slices); backward (s, m, i) needs
its forward, the backward of (s + 1, m, i) (its output's gradient) and of (s, m, i + 1) (the
gradients later slices send into its keys and values). Those are the key/value dependencies of
every token-sliced schedule, and they hold in each direction alike, since both pipelines run the
stages in the same order 0, 1, ..., D - 1; only the ranks differ. So every slicing is accepted,
equal or unequal, and a micro-batch's slices pipeline through the stages as in TeraPipe.

Why the order cannot deadlock. The run only starts a job after every job it needs has finished,
so it is a valid execution of the step, and each rank's order is its projection (the lowering
keeps a valid execution valid). The run always ends: when nothing runs, the job first by
(entry order, stage, slice) among the forwards not yet run is ready (its inputs come from lower
stages or earlier slices of an earlier-entered micro-batch), and the memory cap is lifted for it
if the cap is what holds it back; once every forward has run, the same holds for backwards.

Constraints, refused with a located error: an even number of stages D >= 2 (with D odd the
middle rank would hold both replicas of the middle stage), at least 2 micro-batches (one per
direction: a replica that runs none would have no gradient to reduce), one rank per stage and pipeline
(`--stages D` on D ranks, no `--virtual-stages`).

Tied parameters (GPT-2's embedding and head, the model Chimera was built for). A tie between the
first and the last stage lands on ranks 0 and D-1, each of which holds a replica of both stages:
there the two stages share one tensor, whose gradient gathers both stages' contributions. The
tie's one `reduce-tied` sums that tensor over every rank holding any replica of a tied stage
(`Header.tie_ranks`), and `reduce-replicas` of the tied stages leaves the tied parameter out, so
each replica of each tied stage contributes once (docs/ir.md, rule W1). A tie between any other
stages works the same way, over the ranks of all their replicas.
"""

from __future__ import annotations

import heapq

from tpc.compiler.schedules.common import Compute, empty
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Instr, Op

NAME = "chimera"
PLACEMENT = "bidirectional"
REPLICAS = 2  # weight replicas of every stage: the down and the up pipeline


def stage_ranks(stages: int) -> tuple[tuple[int, ...], ...]:
    """(rank of the down replica, rank of the up replica) of each stage: (s, D - 1 - s)."""
    return tuple((s, stages - 1 - s) for s in range(stages))


def microbatch_replica(mb: int) -> int:
    """The pipeline micro-batch `mb` runs on: down (0) for even, up (1) for odd."""
    return mb % 2


def check_header(header: Header, schedule: str = NAME) -> None:
    """Chimera's constraints (module docstring), each a located error."""
    D = header.num_stages
    if D < 2 or D % 2:
        raise TpirError(Diagnostic(
            f"schedule {schedule!r} runs two pipelines in opposite directions over the same "
            f"stages, one stage of each on every rank, so it needs an even number of stages, "
            f"not {D}", where=f"--schedule {schedule}",
            hint=f"use --stages {max(2, D + (D % 2))} (on as many ranks)"))
    if len(header.microbatches) < 2:
        raise TpirError(Diagnostic(
            f"schedule {schedule!r} sends every other micro-batch the other way: it needs at "
            f"least 2 micro-batches, one per direction, not {len(header.microbatches)}",
            where="--microbatches", hint=f"use --microbatches {D} (one of Chimera's basic units)"))
    want = stage_ranks(D)
    got = tuple(st.ranks for st in header.stages)
    if got != want or header.mesh.pipe != D:
        where = ", ".join(f"stage {st.index} on {list(st.ranks)}" for st in header.stages)
        raise TpirError(Diagnostic(
            f"schedule {schedule!r} needs stage s on ranks s and {D}-1-s (its two weight "
            f"replicas), but the plan has {where}", where=f"--schedule {schedule}",
            hint="let `tpc compile --schedule chimera` place the stages (one per rank and "
                 "pipeline), without --virtual-stages"))


def build(header: Header) -> Compute:
    return build_order(header, doubling=False)


def build_order(header: Header, *, doubling: bool, schedule: str = NAME) -> Compute:
    """Chimera's order (module docstring); with `doubling`, forward doubling
    (compiler/schedules/chimera_doubling.py): the forwards of two micro-batches of one pipeline
    run together, one after the other, and a rank holds up to 2D micro-batches' activations."""
    check_header(header, schedule)
    jobs = _Jobs(header, doubling)
    # the runs under B = F give Chimera's own order (its figures assume F = B); under B = 2F
    # the concatenated units leave bubbles in the middle that another rule or cost may fill
    # better: keep the shortest step under B = 2F, the usual cost of a backward
    runs = [_run(jobs, backward=b, rule=rule) for b in (1, 2) for rule in FORWARD_RULES]
    return min((order for order, _ in runs), key=lambda order: _replay(header, order, backward=2))


def forward_groups(header: Header, doubling: bool) -> tuple[tuple[int, ...], ...]:
    """The micro-batches whose forwards run together, in entry order: each alone, or with
    `doubling` pairs of consecutive micro-batches of one pipeline (m and m + 2) cut into the same
    slices; a micro-batch without such a partner (the last of its pipeline, or one cut
    otherwise) runs alone."""
    mbs = header.microbatches
    if not doubling:
        return tuple((m,) for m in range(len(mbs)))
    groups, open_ = [], {}  # open_: replica -> the group still waiting for its partner
    for m, mb in enumerate(mbs):
        g = open_.pop(mb.replica, None)
        if g is not None and mbs[g[0]].lengths == mb.lengths:
            g.append(m)
            continue
        groups.append([m])
        open_[mb.replica] = groups[-1]
    return tuple(tuple(g) for g in groups)


class _Jobs:
    """The jobs of one step: forward (0, stage, group, slice) of a group's micro-batches
    (`forward_groups`), backward (1, stage, micro-batch, slice); what each needs, costs and
    where it runs."""

    def __init__(self, header: Header, doubling: bool):
        self.header = header
        self.D = header.num_stages
        self.lengths = [m.lengths for m in header.microbatches]
        self.groups = forward_groups(header, doubling)
        self.group_of = {m: g for g, members in enumerate(self.groups) for m in members}
        # a rank holds at most D micro-batches' activations (1F1B's first rank), 2D doubled
        self.cap = self.D * (2 if doubling else 1)

    def members(self, job) -> tuple[int, ...]:
        return self.groups[job[2]] if job[0] == 0 else (job[2],)

    def rank(self, job) -> int:
        return self.header.stage_rank(job[1], self.members(job)[0])

    def slices(self, job) -> int:
        return len(self.lengths[self.members(job)[0]])

    def cost(self, job, backward: float) -> float:
        per = 1 if job[0] == 0 else backward
        return per * sum(self.lengths[m][job[3]] for m in self.members(job))

    def needs(self, job) -> list:
        """The jobs `job` waits for (module docstring; a doubled forward waits for the inputs of
        both its micro-batches)."""
        kind, s, u, i = job
        if kind == 0:
            return ([(0, s - 1, u, i)] if s > 0 else []) + ([(0, s, u, i - 1)] if i > 0 else [])
        out = [(0, s, self.group_of[u], i)]
        if s < self.D - 1:
            out.append((1, s + 1, u, i))
        if i + 1 < len(self.lengths[u]):
            out.append((1, s, u, i + 1))
        return out

    def all(self):
        """Every job, forwards per group, backwards per micro-batch."""
        for g, members in enumerate(self.groups):
            for s in range(self.D):
                for i in range(len(self.lengths[members[0]])):
                    yield (0, s, g, i)
        for m in range(len(self.lengths)):
            for s in range(self.D):
                for i in range(len(self.lengths[m])):
                    yield (1, s, m, i)


def _needs(job, D: int, lengths) -> list:
    """The jobs a micro-batch's `job` waits for (module docstring): job = (kind 0 F | 1 B,
    stage, mb, slice)."""
    kind, s, m, i = job
    if kind == 0:
        return ([(0, s - 1, m, i)] if s > 0 else []) + ([(0, s, m, i - 1)] if i > 0 else [])
    out = [(0, s, m, i)]
    if s < D - 1:
        out.append((1, s + 1, m, i))
    if i + 1 < len(lengths[m]):
        out.append((1, s, m, i + 1))
    return out


def _replay(header: Header, order: Compute, backward: float) -> float:
    """The step time of each rank's instructions run in its order, each when its needs are
    done, under F = 1, B = `backward` per token (free messages): a doubled forward's two
    micro-batches each start when their own input is there, as the executors run them."""
    D = header.num_stages
    lengths = [m.lengths for m in header.microbatches]
    jobs_of = {r: [(0 if i.op is Op.FORWARD else 1, i.stage, i.mb, i.slice) for i in instrs]
               for r, instrs in order.items()}
    end: dict = {}
    ptr = {r: 0 for r in jobs_of}
    clock = {r: 0.0 for r in jobs_of}
    moved = True
    while moved:
        moved = False
        for r, todo in jobs_of.items():
            while ptr[r] < len(todo):
                job = todo[ptr[r]]
                deps = _needs(job, D, lengths)
                if any(n not in end for n in deps):
                    break
                begin = max([clock[r]] + [end[n] for n in deps])
                end[job] = clock[r] = begin + lengths[job[2]][job[3]] * (1 if job[0] == 0 else backward)
                ptr[r] += 1
                moved = True
    return max(clock.values(), default=0.0)


# how a free rank picks among its ready forwards (module docstring): by entry order; by the
# longest chain of work from the forward to the end of the step; by pairs of micro-batches (one
# per direction), slice by slice
FORWARD_RULES = ("entry", "critical", "paired")


def _run(jobs: _Jobs, backward: float, rule: str = "entry"):
    """(compute order, each rank's jobs in order) of the run of the module docstring, jobs
    costing F = 1, B = `backward` per token, forwards picked by `rule` (FORWARD_RULES)."""
    header, D = jobs.header, jobs.D

    def cost(job):
        return jobs.cost(job, backward)

    left: dict[int, int] = {r: 0 for r in range(header.mesh.pipe)}  # jobs not yet started
    ready: dict[int, list] = {r: [] for r in left}  # jobs whose needs are all done, per rank
    waiting: dict = {}  # job -> how many of its needs are not done
    users: dict = {}  # job -> the jobs that need it
    backwards_left: dict[tuple[int, int], int] = {}  # (rank, mb) -> its backwards not yet done
    for job in jobs.all():
        r = jobs.rank(job)
        left[r] += 1
        needs = jobs.needs(job)
        waiting[job] = len(needs)
        for n in needs:
            users.setdefault(n, []).append(job)
        if not needs:
            ready[r].append(job)
        if job[0] == 1:
            backwards_left[(r, job[2])] = backwards_left.get((r, job[2]), 0) + 1
    holding = {r: set() for r in left}  # micro-batches with live activations on rank r
    order: Compute = empty(header)
    jobs_of: dict[int, list] = {r: [] for r in left}
    free_at = {r: 0.0 for r in left}
    running: list = []  # heap of (end time, rank, job)

    def priority(job):
        kind, s, u, i = job
        m = jobs.members(job)[0]  # a forward group enters with its first micro-batch
        # backwards first (by entry order, slices in reverse token order, stages from the last);
        # then forwards by `rule`: by entry order (slices in token order, stages from the first),
        # by the longest way to the end, or slice by slice over a pair of micro-batches
        if rule == "critical":
            return (-kind, -path(job), m, i)
        if rule == "paired":
            return (-kind, (m // 2, i, m) if kind == 0 else (m, -i), s if kind == 0 else -s)
        return (-kind, m, i if kind == 0 else -i, s if kind == 0 else -s)

    tail: dict = {}

    def path(job):  # the longest chain of work from the start of job to the end of the step
        if job not in tail:
            kind, s, u, i = job
            nxt = []
            if kind == 0:
                if s < D - 1:
                    nxt.append((0, s + 1, u, i))
                if i + 1 < jobs.slices(job):
                    nxt.append((0, s, u, i + 1))
                nxt.extend((1, s, m, i) for m in jobs.members(job))
            else:
                if s > 0:
                    nxt.append((1, s - 1, u, i))
                if i > 0:
                    nxt.append((1, s, u, i - 1))
            tail[job] = cost(job) + max((path(n) for n in nxt), default=0)
        return tail[job]

    def fits(job, r: int) -> bool:
        new = [m for m in jobs.members(job) if m not in holding[r]]
        return not new or len(holding[r]) + len(new) <= jobs.cap

    def pick(r: int, relax: bool):
        for j in sorted(ready[r], key=priority):
            if j[0] == 1 or relax or fits(j, r):
                return j
        return None

    def start(job, r: int, now: float) -> None:
        kind, s, u, i = job
        ready[r].remove(job)
        left[r] -= 1
        for m in jobs.members(job):
            if kind == 0:
                holding[r].add(m)
            order[r].append(Instr(Op.FORWARD if kind == 0 else Op.BACKWARD, stage=s, mb=m, slice=i))
        jobs_of[r].append(job)
        free_at[r] = now + cost(job)
        heapq.heappush(running, (free_at[r], r, job))

    now = 0.0
    while any(left.values()) or running:
        for r in sorted(left):
            if free_at[r] <= now and ready[r]:
                job = pick(r, relax=False)
                if job is not None:
                    start(job, r, now)
        if not running:  # nothing runs anywhere: the memory cap gives way (docstring)
            r, job = next((r, j) for r in sorted(left) if ready[r]
                          for j in [pick(r, relax=True)] if j is not None)
            start(job, r, now)
        now = running[0][0]
        while running and running[0][0] == now:
            _, r, job = heapq.heappop(running)
            for user in users.get(job, ()):
                waiting[user] -= 1
                if not waiting[user]:
                    ready[jobs.rank(user)].append(user)
            if job[0] == 1:
                backwards_left[(r, job[2])] -= 1
                if not backwards_left[(r, job[2])]:
                    holding[r].discard(job[2])
    return order, jobs_of
