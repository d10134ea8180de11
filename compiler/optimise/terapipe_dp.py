"""TeraPipe's dynamic program over token slices, with the knapsack over the batch.

The pipeline latency of a step with K stages, whose micro-batches are cut into slices that each
occupy a stage for t_i seconds, is (TeraPipe, eq. 5)

    T = sum_i t_i + (K - 1) * max_j t_j.

Fix the max term t_max. Then, per micro-batch size b, the best slicing of one sequence is a
shortest path over prefix lengths (eq. 6-7):

    S_b(0) = 0,   S_b(x) = min over last slice length l of  S_b(x - l) + t(l, x - l, b),
                  only over slices with t(l, x - l, b) <= t_max,

and the batch of B sequences is cut into micro-batches by a knapsack over sizes (eq. 8):

    Q(0) = 0,     Q(y) = min over b <= y of Q(y - b) + S_b(L),

so T(t_max) = Q(B) + (K - 1) * t_max, minimised over t_max. Q(B; t_max) does not increase as
t_max grows, so over an interval [t_a, t_b] of candidate values T >= Q(B; t_b) + (K-1) * t_a:
a branch and bound over the sorted candidates evaluates the DP at few of them and prunes the
rest, and stays exact (every optimum's max term is one of the candidates). Each evaluation runs
the DP for all micro-batch sizes and all pending thresholds at once, vectorised with numpy.

Lengths move in steps of `granularity` tokens (the last step may be shorter when it does not
divide L). Slice times come from `slot_times` (bottleneck stage, forward + backward + sends).
The DP assumes a slice's time does not fall when its context grows, to skip slices that are
too slow even with no context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INF = np.inf


def positions(L: int, granularity: int) -> np.ndarray:
    """Token positions where a slice may start or end: 0, g, 2g, ..., L."""
    if L < 1 or granularity < 1:
        raise ValueError("sequence length and granularity must be >= 1")
    return np.unique(np.append(np.arange(0, L, granularity), L)).astype(np.int64)


@dataclass(frozen=True)
class SlotTables:
    """Slice times for every (end position, length) and micro-batch size, in a ragged layout.

    Size `sizes[i]` may use slices of 1..widths[i] granules (longer ones exceed the cap).
    Column r of `times` is the pair (size_idx[r], k_idx[r]) and `times[j, r]` is the slot time
    of the slice [pos[j-k-1], pos[j]) for k = k_idx[r], inf where it would start before 0 or
    is slower than the cap. Columns of one size are contiguous, starting at starts[i]: sizes
    with a big micro-batch reach the cap at short slices, so a ragged table is several times
    smaller than a rectangular one.
    """

    pos: np.ndarray
    sizes: tuple[int, ...]
    widths: np.ndarray
    times: np.ndarray  # (n + 1, R)

    @property
    def n(self) -> int:
        return len(self.pos) - 1

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.widths)[:-1])).astype(np.int64)

    @property
    def size_idx(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.sizes)), self.widths)

    @property
    def k_idx(self) -> np.ndarray:
        return np.concatenate([np.arange(w) for w in self.widths])

    def column(self, size_index: int) -> slice:
        st = int(self.starts[size_index])
        return slice(st, st + int(self.widths[size_index]))


def build_tables(slot_fn, L: int, granularity: int, sizes, t_cap: float = INF) -> SlotTables:
    """Evaluate `slot_fn(l, c, b)` (numpy arrays) on every slice no slower than `t_cap`."""
    pos = positions(L, granularity)
    n = len(pos) - 1
    sizes = tuple(int(b) for b in sizes)
    lengths = pos[1:]  # the slice [0, pos[k+1]) has k+1 granules
    widths = np.full(len(sizes), n, dtype=np.int64)
    if np.isfinite(t_cap):
        # the widest slice a size may use: slot(l, 0, b) <= t_cap (context only adds time)
        for i, b in enumerate(sizes):
            t0 = slot_fn(lengths, np.zeros_like(lengths), np.full_like(lengths, b))
            ok = np.nonzero(t0 <= t_cap)[0]
            widths[i] = int(ok[-1]) + 1 if len(ok) else 1
    size_idx = np.repeat(np.arange(len(sizes)), widths)
    k_idx = np.concatenate([np.arange(w) for w in widths])
    j = np.arange(n + 1)[:, None]
    start = j - k_idx[None, :] - 1
    valid = start >= 0
    lo = pos[np.where(valid, start, 0)]
    hi = np.broadcast_to(pos[j], valid.shape)
    b = np.broadcast_to(np.asarray(sizes)[size_idx][None, :], valid.shape)
    times = np.full(valid.shape, INF)
    t = slot_fn(hi[valid] - lo[valid], lo[valid], b[valid])
    times[valid] = np.where(t <= t_cap, t, INF)
    return SlotTables(pos=pos, sizes=sizes, widths=widths, times=times)


def prefix_dp(tables: SlotTables, thresholds: np.ndarray) -> np.ndarray:
    """S[m, i] = least sum of slot times slicing one sequence of a micro-batch of sizes[i]
    with every slice <= thresholds[m] (inf when no slicing fits)."""
    thr = np.asarray(thresholds, dtype=np.float64)[:, None]
    m, nb, n = len(thr), len(tables.sizes), tables.n
    w = int(tables.widths.max())
    # S_pad[:, i, w + x] = S_i(x); the w leading columns are the (impossible) negative prefixes
    S_pad = np.full((m, nb, w + n + 1), INF)
    S_pad[:, :, w] = 0.0
    size_idx, k_idx, starts = tables.size_idx, tables.k_idx, tables.starts
    for j in range(1, n + 1):
        t = tables.times[j]
        prev = S_pad[:, size_idx, w + j - 1 - k_idx]  # (m, R)
        total = prev + np.where(t <= thr, t, INF)
        S_pad[:, :, w + j] = np.minimum.reduceat(total, starts, axis=1)
    return S_pad[:, :, w + n]


def best_prefix_slicing(tables: SlotTables, size_index: int, threshold: float):
    """The slices (token order) achieving S[size_index] under `threshold`, and their sum."""
    n = tables.n
    col = tables.column(size_index)
    t_all = tables.times[:, col]
    t_all = np.where(t_all <= threshold, t_all, INF)
    S = np.full(n + 1, INF)
    S[0] = 0.0
    arg = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        k = min(t_all.shape[1], j)
        total = S[j - k:j][::-1] + t_all[j, :k]
        arg[j] = int(total.argmin())
        S[j] = total[arg[j]]
    out = []
    j = n
    while j > 0:
        i = j - int(arg[j]) - 1
        out.append((int(tables.pos[i]), int(tables.pos[j])))
        j = i
    return tuple(reversed(out)), float(S[n])


def knapsack(seq_cost: np.ndarray, sizes, batch: int, count: int | None = None):
    """Q[m] = least total cost of cutting `batch` sequences into micro-batches of `sizes`
    (each of cost seq_cost[m, i]); exactly `count` micro-batches when given. Also the argmin
    table for `knapsack_choice`."""
    m, nb = seq_cost.shape
    sizes = np.asarray(sizes)
    if count is None:
        Q = np.full((m, batch + 1), INF)
        Q[:, 0] = 0.0
        arg = np.full((m, batch + 1), -1, dtype=np.int64)
        for y in range(1, batch + 1):
            ok = sizes <= y
            cand = np.where(ok[None], Q[:, np.maximum(y - sizes, 0)] + seq_cost, INF)
            arg[:, y] = cand.argmin(-1)
            Q[:, y] = np.take_along_axis(cand, arg[:, y][:, None], -1)[:, 0]
        return Q[:, batch], arg
    Q = np.full((m, count + 1, batch + 1), INF)
    Q[:, 0, 0] = 0.0
    arg = np.full((m, count + 1, batch + 1), -1, dtype=np.int64)
    for k in range(1, count + 1):
        for y in range(1, batch + 1):
            ok = sizes <= y
            cand = np.where(ok[None], Q[:, k - 1, np.maximum(y - sizes, 0)] + seq_cost, INF)
            arg[:, k, y] = cand.argmin(-1)
            Q[:, k, y] = np.take_along_axis(cand, arg[:, k, y][:, None], -1)[:, 0]
    return Q[:, count, batch], arg


def knapsack_choice(arg: np.ndarray, sizes, batch: int, count: int | None, row: int = 0) -> list[int]:
    """Indices into `sizes` of the chosen micro-batches (row `row` of a knapsack's argmin)."""
    out = []
    y = batch
    if count is None:
        while y > 0:
            i = int(arg[row, y])
            out.append(i)
            y -= sizes[i]
    else:
        for k in range(count, 0, -1):
            i = int(arg[row, k, y])
            out.append(i)
            y -= sizes[i]
    return out


@dataclass(frozen=True)
class DPResult:
    mb_sizes: tuple[int, ...]
    slices: tuple[tuple[tuple[int, int], ...], ...]  # per micro-batch, token order
    total: float  # sum of slot times + (K-1) * max slot time
    t_max: float
    candidates: int  # distinct t_max values that bound the search
    evaluated: int  # t_max values the DP actually ran for


def search(tables: SlotTables, K: int, batch: int, count: int | None = None,
           split: int = 8, chunk: int = 64) -> DPResult | None:
    """Exact minimum of Q(batch; t_max) + (K-1) t_max over the candidate t_max values.

    Branch and bound over index intervals of the sorted candidates: an interval [a, b] whose
    bound Q(t_b) + (K-1) t_a cannot beat the best total is dropped, one on which Q is constant
    is settled by its left end, and the rest are cut into `split` parts whose inner points the
    next round evaluates together (few rounds, wide vectorised DP calls).
    """
    times = tables.times
    cands = np.unique(times[np.isfinite(times)])
    if len(cands) == 0:
        return None
    memo: dict[int, float] = {}

    def evaluate(idxs):
        todo = sorted({int(i) for i in idxs if int(i) not in memo})
        for s in range(0, len(todo), chunk):
            part = todo[s:s + chunk]
            seq_cost = prefix_dp(tables, cands[part])
            q, _ = knapsack(seq_cost, tables.sizes, batch, count)
            memo.update(zip(part, q.tolist()))

    def total(i):
        return memo[i] + (K - 1) * cands[i]

    last = len(cands) - 1
    grid = np.unique(np.linspace(0, last, min(len(cands), 4 * split)).round().astype(int))
    evaluate(grid)
    best_i = min(grid.tolist(), key=total)
    best = total(best_i)
    frontier = list(zip(grid[:-1].tolist(), grid[1:].tolist()))
    while frontier:
        keep = []
        for a, b in frontier:
            if memo[b] + (K - 1) * cands[a] >= best:
                continue  # no threshold in [a, b] can beat the best
            if memo[a] == memo[b] or b - a <= 1:
                for i in (a, b):
                    if total(i) < best:
                        best, best_i = total(i), i
                continue
            keep.append((a, b))
        cuts = [np.unique(np.linspace(a, b, split + 1).round().astype(int)) for a, b in keep]
        evaluate([i for c in cuts for i in c[1:-1]])
        frontier = []
        for c in cuts:
            for a, b in zip(c[:-1].tolist(), c[1:].tolist()):
                for i in (a, b):
                    if total(i) < best:
                        best, best_i = total(i), i
                frontier.append((a, b))
    if not np.isfinite(best):
        return None
    return _reconstruct(tables, K, batch, count, cands[best_i], len(cands), len(memo))


def _reconstruct(tables, K, batch, count, thr, n_cands, n_eval) -> DPResult:
    seq_cost = prefix_dp(tables, np.array([thr]))
    _, arg = knapsack(seq_cost, tables.sizes, batch, count)
    picks = knapsack_choice(arg, tables.sizes, batch, count)
    picks.sort(key=lambda i: -tables.sizes[i])
    per_size = {i: best_prefix_slicing(tables, i, thr) for i in set(picks)}
    mb_sizes = tuple(tables.sizes[i] for i in picks)
    slices = tuple(per_size[i][0] for i in picks)
    t_sum = float(sum(per_size[i][1] for i in picks))
    t_max = max(_slice_time(tables, i, sl) for i in set(picks) for sl in per_size[i][0])
    return DPResult(mb_sizes=mb_sizes, slices=slices, total=t_sum + (K - 1) * t_max,
                    t_max=t_max, candidates=n_cands, evaluated=n_eval)


def _slice_time(tables: SlotTables, size_index: int, sl: tuple[int, int]) -> float:
    i = int(np.searchsorted(tables.pos, sl[0]))
    j = int(np.searchsorted(tables.pos, sl[1]))
    return float(tables.times[j, tables.column(size_index)][j - i - 1])
