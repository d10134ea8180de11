"""The plan search: mesh, stage partition, token slicing and schedule, by simulated step time.

`tpc compile` calls `search_plan` whenever a cost model is named (--cost / --device-model).
What is searched depends on the options; everything else is held fixed:

* meshes (`--stages auto --ranks N`): every pipe x data split of N with pipe <= units, the
  batch divisible by data and at least `--microbatches` sequences per replica; with a tensor
  degree T (`--tensor T`) every pipe x data split of N / T, and with `--tensor auto` every
  pipe x data x tensor split of N whose tensor degree the model's split accepts (the caller
  says which: compiler/pipeline.py); each mesh priced by the cost source split over its T ranks
  (`CostSource.split`);
* per mesh, a stage partition from the cost model's per-unit times (compiler/optimise/balance.py).
  With `--slices auto` it is found jointly with the slicing by alternating two exact steps:
  TeraPipe's DP (compiler/optimise/slice_optimiser.py) for the partition, then the partition minimising the
  DP's latency formula for that slicing, until the partition repeats (at most `ROUNDS` DP
  runs); the round with the lowest DP prediction is kept. With given slices, the partition
  minimising the formula for them;
* per mesh, the slicings to simulate: the DP's choice, and n equal slices of equal
  micro-batches for every n dividing L into slices of at least `granularity` tokens (the
  formula is an approximation of the real schedule; simulating the simple alternatives too
  means the plan chosen is never slower, simulated, than the best equal slicing). With given
  slices, just those;
* schedules (`--schedule auto`): terapipe, seq1f1b, 1f1b, gpipe, zb-h1, zb-h2, seq-zb, and the
  V-shaped zbv and dualpipev. A V-shaped schedule runs 2 x pipe stages on the pipe ranks of a mesh
  (stage i and 2p-1-i on rank i), partitioned for that many stages; it is left out of a mesh whose
  model has fewer units, and dualpipev of a slicing with fewer than 2 x pipe micro-batches. A
  rank's memory is the simulator's, which counts every stage the rank holds (both chunks of a V).

Every (mesh, slicing, schedule), in that order, is built (header, schedule, lowering for the
backend `--comm` names) and simulated under the partition's cost model and that backend's rules
(NCCL's by default, as `tpc compile` lowers for NCCL); its peak memory per rank is the simulator's
(compiler/predict/memory.py). The fastest candidate whose peak fits `--memory-per-rank` wins; among
equally fast ones (within a relative 1e-9) the one with the lowest peak memory, then the first
in that order (tensor ascending, then pipe ascending, the DP's slicing first, schedules in the
order listed).

A candidate is not built when its busiest rank's own compute (`busy_bound`, no schedule can do
better) already exceeds the fastest fitting plan found so far: thin equal slicings, which pay
per-slice overheads many times, are ruled out without simulating them.

Cost: meshes x (at most ROUNDS DP runs + slicings x schedules simulations), slicings being
1 + the equal-slicing counts (log2(L/granularity) + 1 for a power-of-two L). A simulation and
its lowering are linear in the plan's instructions, about K x (slices of all micro-batches) x
(2 computes + 4 messages); slice times are priced once per mesh and remembered. A DP run is
what bench/dp_speed.py measures. The tiny test GPT (4 units, L 64, --ranks 4, both 'auto'):
3 meshes, at most 48 small simulations, well under a second; bench/dp_speed.py --search
times a 24-layer model on 8 and 16 ranks.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tpc.compiler.costmodel.base import transfer_times
from tpc.compiler.costmodel.source import CostSource
from tpc.compiler.lowering.lower import DEFAULT_EXCHANGES, Exchanges
from tpc.compiler.optimise.balance import Ranges, best_partition, minmax_partition
from tpc.compiler.optimise.slice_optimiser import DEFAULT_GRANULARITY, Choice, optimise
from tpc.compiler.optimise.slice_optimiser import explain as explain_choice
from tpc.compiler.optimise.slicing import even_split
from tpc.compiler.predict.quantities import format_bytes
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Microbatch
from tpc.ir.semantics import DEFAULT_COMM, CommRules

# the schedules `--schedule auto` compares, in the order that breaks ties
# (the zero-bubble ones after the plain ones: a tie keeps the simpler schedule; the looped
# schedules of several chunks per rank are not among them, the V-shaped ones are, and so is
# chimera (plain and with forward doubling), tied weights or not; a schedule that refuses the
# shape is left out)
AUTO_SCHEDULES = ("terapipe", "seq1f1b", "1f1b", "gpipe", "zb-h1", "zb-h2", "seq-zb", "zbv", "dualpipev",
                  "chimera", "chimera-doubling")
# Merak's critical-path 1F1B (compiler/schedules/critical_path.py): compared too when every
# candidate is recomputed (`--recompute full`), since they differ from 1f1b only in where and
# whether they recompute
RECOMPUTE_SCHEDULES = ("1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")
# DP runs per mesh when the partition and the slicing are chosen together
ROUNDS = 4
# relative difference of simulated times below which two candidates are equally fast
TIE = 1e-9

Slices = tuple[tuple[int, int], ...]
MakeHeader = Callable[[int, int, Ranges, str, tuple[Microbatch, ...]], Header]


# ------------------------------------------------------------------------------- meshes


def mesh_text(pipe: int, data: int, tensor: int = 1) -> str:
    """'4x2' (pipe x data), or '2x2x2' (pipe x data x tensor) with a tensor axis."""
    return f"{pipe}x{data}" + (f"x{tensor}" if tensor != 1 else "")


def meshes_for_ranks(ranks: int, num_units: int, batch: int, microbatches: int, tensors=(1,)):
    """(pipe, data, tensor) splits of `ranks` to search, for each tensor degree of `tensors`
    (ascending; those that do not divide `ranks` are left out), pipe ascending, and why the
    others are not."""
    meshes, skipped = [], []
    for tensor in tensors:
        if ranks % tensor:
            continue
        rest = ranks // tensor
        for pipe in range(1, rest + 1):
            if rest % pipe:
                continue
            data = rest // pipe
            name = mesh_text(pipe, data, tensor)
            if pipe > num_units:
                skipped.append(f"{name}: {pipe} stages but the model has {num_units} units")
            elif batch % data:
                skipped.append(f"{name}: a batch of {batch} does not split over {data} replicas")
            elif batch // data < microbatches:
                skipped.append(f"{name}: {batch // data} sequence(s) per replica, fewer than "
                               f"{microbatches} micro-batches")
            else:
                meshes.append((pipe, data, tensor))
    return meshes, skipped


# -------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class Space:
    """What the search may choose among (see the module docstring)."""

    seq_len: int
    batch: int  # global batch, sequences
    microbatches: int | None  # per replica; None: the optimiser's knapsack chooses
    meshes: tuple[tuple[int, ...], ...]  # (pipe, data) or (pipe, data, tensor)
    schedules: tuple[str, ...]
    slices: Slices | None = None  # given slices of every micro-batch; None: the optimiser's
    budget: float | None = None  # bytes per rank
    granularity: int = DEFAULT_GRANULARITY
    skipped: tuple[str, ...] = ()  # meshes left out, and why (for --explain)
    # a fixed stage partition (the other plans of a bundle share the first one's); None: searched
    ranges: Ranges | None = None
    # the backend the plan is for (`--comm`): candidates are lowered for it and simulated under
    # its rules (NCCL's: in-order streams and rendezvous transfers, compiler/predict/simulate.py)
    comm: CommRules = DEFAULT_COMM
    # how NCCL's exchanges are lowered (`--exchanges`): the candidates are the plans written
    exchanges: Exchanges = DEFAULT_EXCHANGES
    # the run shards its optimizer state over the data-parallel group (`--shard-optimizer`)
    shard_optimizer: bool = False
    # `--recompute full`: each candidate is simulated recomputed, as it will be written (a
    # schedule that places its own recomputation as it places it); otherwise as built
    recompute: str = "none"


@dataclass(frozen=True)
class Slicing:
    origin: str  # "dp", "equal N" or "given"
    mb_sizes: tuple[int, ...]
    slices: tuple[Slices, ...]  # per micro-batch
    choice: Choice | None = None  # the optimiser's result, for "dp"

    def microbatches(self) -> tuple[Microbatch, ...]:
        return tuple(Microbatch(index=m, size=b, slices=s)
                     for m, (b, s) in enumerate(zip(self.mb_sizes, self.slices)))

    def summary(self) -> str:
        counts = {len(s) for s in self.slices}
        sizes = {b for b in self.mb_sizes}
        mbs = (f"{len(self.mb_sizes)}x{self.mb_sizes[0]}" if len(sizes) == 1
               else "+".join(map(str, self.mb_sizes)))
        sl = (f"{counts.pop()} slices" if len(counts) == 1
              else f"{sum(len(s) for s in self.slices)} slices in all")
        return f"{self.origin}: mb {mbs}, {sl}"


@dataclass(frozen=True)
class Candidate:
    pipe: int
    data: int
    ranges: Ranges
    schedule: str
    slicing: Slicing
    time: float  # simulated step time (s); for one not simulated, the bound that ruled it out
    peak: float  # largest peak memory of any rank (bytes); nan when not simulated
    fits: bool  # simulated and within the budget
    header: Header | None  # None when not simulated
    simulated: bool = True
    tensor: int = 1  # tensor ranks per stage

    @property
    def mesh(self) -> str:
        return mesh_text(self.pipe, self.data, self.tensor)


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...]
    best: Candidate
    space: Space
    seconds: float
    dp_runs: int


def search_plan(source: CostSource, space: Space, make_header: MakeHeader) -> SearchResult:
    """The fastest simulated plan of `space` that fits its memory budget (module docstring)."""
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.lowering import recompute
    from tpc.compiler.schedules import build_schedule, own_recompute, replicas
    from tpc.compiler.predict.simulate import simulate

    start = time.perf_counter()
    candidates, dp_runs = [], 0
    incumbent = math.inf  # the fastest fitting time so far
    for pipe, data, tensor, per_rank, schedules in _groups(space, source.num_units):
        rows = space.batch // data
        split = source.split(tensor)  # each stage split over the mesh's tensor ranks
        ranges, slicings, runs = _partition_and_slicings(split, space, pipe * per_rank, data, rows)
        dp_runs += runs
        # one memo per mesh: every schedule and slicing asks the same (stage, l, c, b) again
        cost = _Memo(split.for_stages(ranges))
        for slicing in slicings:
            bound = busy_bound(cost.inner, slicing, data, per_rank)
            for schedule in schedules:
                # (a rank of chimera runs half the micro-batches of each of two stages: the bound
                # of one stage per rank does not hold for it)
                if bound > incumbent * (1 + TIE) and replicas(schedule) == 1:
                    # a rank's own compute already takes longer than a plan that fits
                    candidates.append(Candidate(pipe, data, ranges, schedule, slicing, bound,
                                                math.nan, False, None, simulated=False, tensor=tensor))
                    continue
                header = make_header(pipe, data, ranges, schedule, slicing.microbatches(), tensor=tensor)
                try:
                    compute = build_schedule(schedule, header)
                except TpirError:
                    if len(space.schedules) == 1:
                        raise  # the schedule the user named refuses this plan: say why
                    continue  # e.g. dualpipev with fewer than 2 x pipe micro-batches
                if space.recompute == "full" and not own_recompute(schedule):
                    compute = recompute.apply(compute, recompute.uniform(header, "full"))
                plan = lower(header, compute, verify=False, comm=space.comm, exchanges=space.exchanges)
                sim = simulate(plan, cost, space.comm, shard_optimizer=space.shard_optimizer)
                peak = max(r.peak_memory.total for r in sim.ranks)
                fits = space.budget is None or peak <= space.budget
                candidates.append(Candidate(pipe, data, ranges, schedule, slicing,
                                            sim.iteration_time, peak, fits, header, tensor=tensor))
                if fits:
                    incumbent = min(incumbent, sim.iteration_time)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _nothing_fits(candidates, space)
    best = _fastest(fitting)
    return SearchResult(tuple(candidates), best, space, time.perf_counter() - start, dp_runs)


def _groups(space: Space, num_units: int):
    """(pipe, data, tensor, stages per rank, schedules) in search order: per mesh, the schedules
    of one stage per rank, then those of two (the V-shaped ones, 2 x pipe stages: left out where
    the model has fewer units)."""
    from tpc.compiler.schedules import stages_per_rank

    for pipe, data, *rest in space.meshes:
        tensor = rest[0] if rest else 1
        for per_rank in (1, 2):
            names = tuple(n for n in space.schedules if stages_per_rank(n) == per_rank)
            if names and pipe * per_rank <= num_units:
                yield pipe, data, tensor, per_rank, names


def busy_bound(cost, slicing: Slicing, data: int, per_rank: int = 1) -> float:
    """A lower bound on any schedule's step time for a slicing: the busiest rank's compute
    (every forward and backward of its stages: stage s, or with two per rank in a V stages s
    and K-1-s) plus their gradient all-reduces. A slice's backward counts as the cheaper of a
    whole backward and its two halves (a split-backward schedule runs the halves, and measured
    halves may together cost less than the measured whole): with either alone the bound could
    exceed a schedule's simulated time and prune the fastest plan."""
    l = np.array([hi - lo for s in slicing.slices for lo, hi in s], dtype=np.float64)
    c = np.array([lo for s in slicing.slices for lo, _ in s], dtype=np.float64)
    mb = np.array([b for b, s in zip(slicing.mb_sizes, slicing.slices) for _ in s], dtype=np.float64)
    K = cost.num_stages
    work = []
    for stage in range(K):
        f, b = cost.slice_times(stage, l, c, mb)
        t_in, t_w = cost.split_backward_times(stage, l, c, mb)
        b = np.minimum(b, t_in + t_w)
        sync = cost.grad_sync_time(stage, data) if data > 1 else 0.0
        work.append(float(np.sum(f + b)) + sync)
    if per_rank == 2:
        return max(work[r] + work[K - 1 - r] for r in range(K // 2))
    return max(work)


class _Memo:
    """A cost model whose answers are remembered: the simulator asks per instruction, and
    the candidates of one mesh share most (stage, length, context, rows) points."""

    _CACHED = ("slice_time", "split_backward_time", "p2p_time", "activation_bytes", "kv_bytes",
               "param_bytes", "stash_bytes", "grad_sync_time")

    def __init__(self, cost):
        self.inner = cost
        self.num_stages = cost.num_stages
        for name in self._CACHED:
            fn = getattr(cost, name, None)
            if fn is not None:
                setattr(self, name, functools.lru_cache(maxsize=None)(fn))

    def __getattr__(self, name):  # what is not cached is the model's own
        return getattr(self.inner, name)


def _fastest(fitting: list[Candidate]) -> Candidate:
    """The fastest candidate; times within TIE of the fastest count as equal (they differ by
    rounding in the simulator's sums) and among those the lowest peak memory wins, then the
    first in search order."""
    quickest = min(c.time for c in fitting)
    near = [c for c in fitting if c.time <= quickest * (1 + TIE)]
    return min(near, key=lambda c: c.peak)


def _nothing_fits(candidates, space: Space) -> TpirError:
    # nothing is pruned before a candidate fits, so every candidate here was simulated
    low = min(candidates, key=lambda c: c.peak)
    return TpirError(Diagnostic(
        f"no plan fits --memory-per-rank {format_bytes(space.budget)}: of {len(candidates)} "
        f"candidates the smallest peak is {format_bytes(low.peak)} per rank "
        f"({_describe(low)})",
        where="--memory-per-rank",
        hint=f"allow at least {format_bytes(low.peak)} per rank, or spread the model over more "
             "ranks (--stages, --ranks), or cut the batch into more micro-batches"
             + ("" if space.shard_optimizer else ", or shard the optimizer state over data-parallel "
                "replicas (--shard-optimizer, with --dp or --ranks)")
             + ", or recompute activations (--recompute auto)"))


def _describe(c: Candidate) -> str:
    K = len(c.ranges)
    on = f" on {c.pipe} rank{'s' * (c.pipe != 1)}" if K != c.pipe else ""
    tp = f" x {c.tensor} tensor ranks" if c.tensor != 1 else ""
    return (f"{K} stage{'s' * (K != 1)}{on} x {c.data} replica{'s' * (c.data != 1)}{tp}, "
            f"units {partition_text(c.ranges)}, "
            f"{c.schedule}, {c.slicing.summary()}")


def equal_counts(L: int, granularity: int) -> list[int]:
    """Slice counts n for which n equal slices are whole and at least `granularity` long."""
    return [n for n in range(1, L + 1) if L % n == 0 and (L // n >= granularity or n == 1)]


def slice_work(source: CostSource, cost, mb_sizes, slices):
    """W (units x slices) of forward + backward per unit, and each slice's transfers, for
    every slice of every micro-batch of a slicing: what the partitioner balances."""
    l = np.array([hi - lo for s in slices for lo, hi in s], dtype=np.float64)
    c = np.array([lo for s in slices for lo, _ in s], dtype=np.float64)
    mb = np.array([b for b, s in zip(mb_sizes, slices) for _ in s], dtype=np.float64)
    return source.unit_times(l, c, mb), transfer_times(cost, l, mb)


def _partition_and_slicings(source: CostSource, space: Space, pipe: int, data: int, rows: int):
    """The partition of one mesh and the slicings to simulate on it (module docstring)."""
    L, M, g = space.seq_len, space.microbatches, space.granularity
    n_units = source.num_units
    if space.slices is not None:
        sizes = even_split(rows, M)  # given slices come with a given micro-batch count
        given = Slicing("given", sizes, (space.slices,) * M)
        if space.ranges is not None:
            return space.ranges, [given], 0
        # the transfers depend only on the stage count: price them with any partition of it
        probe = source.for_stages(minmax_partition(np.ones(n_units), pipe))
        W, extra = slice_work(source, probe, given.mb_sizes, given.slices)
        return best_partition(W, pipe, extra), [given], 0
    # start from the partition balancing the unsliced step, then alternate DP and partition
    # (with a fixed partition: one DP run on it)
    ranges = space.ranges or minmax_partition(source.unit_times(L, 0, rows / (M or 1)), pipe)
    seen, best, runs = [], None, 0
    while ranges not in seen and runs < (1 if space.ranges is not None else ROUNDS):
        seen.append(ranges)
        cost = source.for_stages(ranges)
        choice = optimise(cost, pipe, L, rows, microbatches=M, granularity=g, data=data)
        runs += 1
        if best is None or choice.predicted_time < best[1].predicted_time:
            best = (ranges, choice)
        W, extra = slice_work(source, cost, choice.mb_sizes, choice.slices)
        ranges = best_partition(W, pipe, extra)
    ranges, choice = best
    slicings = [Slicing("dp", choice.mb_sizes, choice.slices, choice)]
    # the equal slicings keep the given micro-batches, or the knapsack's when it chose them
    sizes = even_split(rows, M) if M is not None else choice.mb_sizes
    for n in equal_counts(L, g):
        cuts = tuple((L * i // n, L * (i + 1) // n) for i in range(n))
        s = Slicing(f"equal {n}", sizes, (cuts,) * len(sizes))
        if (s.mb_sizes, s.slices) != (choice.mb_sizes, choice.slices):
            slicings.append(s)
    return ranges, slicings, runs


# ------------------------------------------------------------------------------- explain


def partition_text(ranges: Ranges) -> str:
    """Units per stage, runs of equal counts shortened: '2+1*94+3'."""
    counts = [hi - lo for lo, hi in ranges]
    parts, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        parts.append(f"{counts[i]}*{j - i}" if j - i > 2 else "+".join([str(counts[i])] * (j - i)))
        i = j
    return "+".join(parts)


def explain(result: SearchResult) -> str:
    """The candidates as a table, then the choice and why (for `tpc compile --explain`)."""
    space, best = result.space, result.best
    budget = format_bytes(space.budget) if space.budget is not None else None
    tensor = any(len(m) > 2 and m[2] != 1 for m in space.meshes)
    rows = [("", "mesh (PxDxT)" if tensor else "mesh", "units/stage", "schedule", "slicing", "step (sim)", "peak/rank", "fits")]
    for c in result.candidates:
        if c.simulated:
            step, peak = f"{c.time * 1e3:.4g} ms", format_bytes(c.peak)
            fits = ("yes" if c.fits else "NO") if budget else "-"
        else:
            step, peak, fits = f">={c.time * 1e3:.4g} ms", "-", "pruned"
        rows.append(("*" if c is best else "", c.mesh, partition_text(c.ranges),
                     c.schedule, c.slicing.summary(), step, peak, fits))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"plan search: {len(result.candidates)} candidates "
             f"({len(space.meshes)} mesh(es) x {len(space.schedules)} schedule(s) x slicings), "
             f"{result.dp_runs} DP run(s), {result.seconds:.2f} s"
             + (f"; memory budget {budget} per rank" if budget else "")]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  not searched: {s}" for s in space.skipped]
    if any(not c.simulated for c in result.candidates):
        lines.append("  pruned: its busiest rank's compute alone (>=) exceeds a plan that fits; "
                     "not built")
    others = sorted((c for c in result.candidates if c.fits and c is not best), key=lambda c: c.time)
    why = f"the fastest simulated step of {len(others) + 1} candidate(s)"
    why += " that fit the budget" if budget else ""
    if others:
        runner = others[0]
        if runner.time > best.time * (1 + TIE):
            how = f"{runner.time / best.time - 1:.1%} slower"
        elif runner.peak > best.peak:
            how = f"as fast, but its peak is {format_bytes(runner.peak - best.peak)} higher"
        else:
            how = "as fast and as small; the earlier in search order wins"
        why += f"; next best {runner.time * 1e3:.4g} ms ({_describe(runner)}), {how}"
    lines.append(f"chosen: {_describe(best)}: {best.time * 1e3:.4g} ms, "
                 f"peak {format_bytes(best.peak)} per rank")
    lines.append(f"  why: {why}")
    # what the DP chose on the chosen mesh (its formula's prediction differs from the simulation)
    dp = next((c.slicing.choice for c in result.candidates if c.slicing.choice is not None
               and (c.pipe, c.data, c.tensor) == (best.pipe, best.data, best.tensor)), None)
    if dp is not None:
        lines += ["  " + line for line in explain_choice(dp).splitlines()]
    return "\n".join(lines)
