"""The optimiser: micro-batches and token slices (TeraPipe's DP), and the choices around it.

`optimise` is what `tpc compile --slices auto` calls. It returns a `Choice`: the micro-batch
sizes, the token slices of each micro-batch, and the predicted step time under the cost model,
with enough bookkeeping for `explain` to say why.

Search space and its limits:
  * slice boundaries on multiples of `granularity` tokens (and L);
  * any micro-batch size 1..batch (or up to `max_mb_size`), any number of micro-batches, or
    exactly `microbatches` of them;
  * latency of a GPipe-ordered token pipeline: sum of slot times + (K-1) * max slot time
    (see compiler/optimise/terapipe_dp.py), plus the data-parallel gradient sync when the model prices it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tpc.compiler.costmodel.base import CostModel, slot_times
from tpc.compiler.optimise import terapipe_dp as dp
from tpc.ir.diagnostics import Diagnostic, TpirError

DEFAULT_GRANULARITY = 8


@dataclass(frozen=True)
class Choice:
    mb_sizes: tuple[int, ...]
    # per micro-batch, the token slices as [start, end) pairs in token order
    slices: tuple[tuple[tuple[int, int], ...], ...]
    predicted_time: float
    # what the same model predicts with batch slicing only (each micro-batch one slice)
    unsliced_time: float
    t_max: float
    candidates: int
    evaluated: int
    stages: int
    seq_len: int
    granularity: int
    sync_time: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def num_slices(self) -> int:
        return sum(len(s) for s in self.slices)


def _slot_fn(cost: CostModel, backward: bool = True):
    return lambda l, c, b: slot_times(cost, l, c, b, backward)


def _check_inputs(K: int, L: int, batch: int, microbatches: int | None, granularity: int):
    problems = []
    if K < 1:
        problems.append(("stages must be >= 1", f"got {K}"))
    if L < 1:
        problems.append(("sequence length must be >= 1", f"got {L}"))
    if batch < 1:
        problems.append(("batch per replica must be >= 1", f"got {batch}"))
    if granularity < 1:
        problems.append(("slice granularity must be >= 1", f"got {granularity}"))
    if microbatches is not None and not 1 <= microbatches <= batch:
        problems.append((f"cannot cut a batch of {batch} into {microbatches} micro-batches",
                         f"give --microbatches between 1 and {batch}"))
    if problems:
        raise TpirError([Diagnostic(m, where="optimiser", hint=h) for m, h in problems])


def sync_time_of(cost: CostModel, data: int) -> float:
    """Gradient all-reduce over data replicas after the pipeline drains (slowest stage)."""
    if data <= 1:
        return 0.0
    return max(cost.grad_sync_time(s, data) for s in range(cost.num_stages))


def batch_only(cost: CostModel, K: int, L: int, batch: int, microbatches: int | None = None,
               max_mb_size: int | None = None, backward: bool = True) -> dp.DPResult:
    """Best cut of the batch into micro-batches with no token slicing (GPipe's search)."""
    sizes = tuple(range(1, (max_mb_size or batch) + 1))
    t = slot_times(cost, np.full(len(sizes), L), np.zeros(len(sizes)), np.array(sizes), backward)
    pos = np.array([0, L])
    times = np.full((2, len(sizes)), np.inf)
    times[1] = t
    tables = dp.SlotTables(pos=pos, sizes=sizes, widths=np.ones(len(sizes), dtype=np.int64),
                           times=times)
    res = dp.search(tables, K, batch, microbatches)
    if res is None:
        raise TpirError(Diagnostic(
            f"no way to cut a batch of {batch} into micro-batches of at most {max_mb_size}",
            where="optimiser", hint="raise the largest micro-batch size or change --microbatches"))
    return res


def _uniform_bound(slot, K, L, batch, microbatches, granularity) -> float:
    """A quick feasible total: equal micro-batches, each cut into 2^k equal slices."""
    count = microbatches or batch
    if batch % count:
        return np.inf
    b = batch // count
    best = np.inf
    pos = dp.positions(L, granularity)
    n = len(pos) - 1
    pieces = 1
    while pieces <= n:
        cuts = pos[np.linspace(0, n, pieces + 1).round().astype(int)]
        lo, hi = cuts[:-1], cuts[1:]
        t = slot(hi - lo, lo, np.full(len(lo), b))
        best = min(best, count * float(t.sum()) + (K - 1) * float(t.max()))
        pieces *= 2
    return best


def optimise(cost: CostModel, K: int, L: int, batch: int, microbatches: int | None = None,
             granularity: int = DEFAULT_GRANULARITY, token_slicing: bool = True,
             max_mb_size: int | None = None, data: int = 1, backward: bool = True) -> Choice:
    """Micro-batch sizes and token slices minimising the predicted step time.

    `batch` is the batch of one data-parallel replica; `data` the number of replicas (only
    the gradient sync depends on it). `microbatches=None` lets the knapsack choose how many.
    `backward=False` prices a forward-only program (evaluation): a slot is the forward and the
    activation's transfer, and there is no gradient sync.
    """
    _check_inputs(K, L, batch, microbatches, granularity)
    max_mb = min(max_mb_size or batch, batch)
    if microbatches is not None and microbatches * max_mb < batch:
        raise TpirError(Diagnostic(
            f"{microbatches} micro-batches of at most {max_mb} cannot hold a batch of {batch}",
            where="optimiser", hint="allow more micro-batches or larger ones"))
    slot = _slot_fn(cost, backward)
    base = batch_only(cost, K, L, batch, microbatches, max_mb, backward)
    sync = sync_time_of(cost, data) if backward else 0.0
    notes = []
    if not token_slicing or L <= granularity:
        best = base
    else:
        bound = min(base.total, _uniform_bound(slot, K, L, batch, microbatches, granularity))
        # a slice slower than bound/(K-1) makes (K-1)*t_max alone exceed a known total
        cap = bound / (K - 1) if K > 1 else np.inf
        sizes = tuple(range(1, max_mb + 1))
        tables = dp.build_tables(slot, L, granularity, sizes, t_cap=cap * (1 + 1e-12))
        best = dp.search(tables, K, batch, microbatches) or base
        if best.total > base.total:  # cannot happen with exact search; keep the better
            best = base
        notes.append(f"slices up to {int(tables.widths.max()) * granularity} tokens priced "
                     f"(cap {cap * 1e3:.3f} ms per slot from a known total of {bound:.4f} s)")
    return Choice(mb_sizes=best.mb_sizes, slices=best.slices, predicted_time=best.total + sync,
                  unsliced_time=base.total + sync, t_max=best.t_max, candidates=best.candidates,
                  evaluated=best.evaluated, stages=K, seq_len=L, granularity=granularity,
                  sync_time=sync, notes=tuple(notes))


def best_slicing(cost: CostModel, K: int, L: int, mb_size: int,
                 granularity: int = DEFAULT_GRANULARITY) -> tuple[tuple[tuple[int, int], ...], float]:
    """Token slices of one micro-batch of `mb_size` sequences alone, and its predicted time."""
    ch = optimise(cost, K, L, mb_size, microbatches=1, granularity=granularity)
    return ch.slices[0], ch.predicted_time


def explain(choice: Choice) -> str:
    """What the optimiser chose and why, for `tpc compile --explain`."""
    lines = [f"optimiser: {choice.stages} stages, sequence {choice.seq_len}, "
             f"granularity {choice.granularity} tokens"]
    groups: dict[tuple, int] = {}
    for size, sl in zip(choice.mb_sizes, choice.slices):
        key = (size, tuple(hi - lo for lo, hi in sl))
        groups[key] = groups.get(key, 0) + 1
    for (size, lengths), n in groups.items():
        lines.append(f"  {n} x micro-batch of {size}: {len(lengths)} slices "
                     f"[{', '.join(map(str, lengths))}]")
    lines.append(f"  predicted step {choice.predicted_time:.6g} s "
                 f"(max slot {choice.t_max * 1e3:.4g} ms x {choice.stages - 1} fill"
                 + (f", gradient sync {choice.sync_time:.4g} s" if choice.sync_time else "") + ")")
    speed = choice.unsliced_time / choice.predicted_time if choice.predicted_time > 0 else 1.0
    lines.append(f"  without token slicing: {choice.unsliced_time:.6g} s "
                 f"-> token slicing {speed:.2f}x")
    lines.append(f"  search: {choice.candidates} distinct slot times bound the max term, "
                 f"the DP ran for {choice.evaluated} of them")
    lines += [f"  note: {n}" for n in choice.notes]
    return "\n".join(lines)
