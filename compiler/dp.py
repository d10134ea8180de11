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
    """Slice times for every (end position j, length k+1 granules) and micro-batch size.

    `times[i, j, k]` is the slot time of the slice [pos[j-k-1], pos[j]) of a micro-batch of
    `sizes[i]` sequences, inf where the slice would start before 0 or exceeds the cap.
    """

    pos: np.ndarray
    sizes: tuple[int, ...]
    times: np.ndarray  # (len(sizes), n + 1, width)

    @property
    def n(self) -> int:
        return len(self.pos) - 1

    @property
    def width(self) -> int:
        return self.times.shape[2]


def build_tables(slot_fn, L: int, granularity: int, sizes, t_cap: float = INF) -> SlotTables:
    """Evaluate `slot_fn(l, c, b)` (numpy arrays) on every slice no slower than `t_cap`."""
    pos = positions(L, granularity)
    n = len(pos) - 1
    sizes = tuple(int(b) for b in sizes)
    # widest slice any size may use: slot(l, 0, b) <= t_cap, growing l from one granule
    lengths = pos[1:]  # slice [0, pos[k+1]) has k+1 granules
    width = 1
    if np.isfinite(t_cap):
        for b in sizes:
            t0 = slot_fn(lengths, np.zeros_like(lengths), np.full_like(lengths, b))
            ok = np.nonzero(t0 <= t_cap)[0]
            if len(ok):
                width = max(width, int(ok[-1]) + 1)
    else:
        width = n
    j = np.arange(n + 1)[:, None]
    k = np.arange(width)[None, :]
    start = j - k - 1
    valid = start >= 0
    s_idx = np.where(valid, start, 0)
    lo = pos[s_idx]
    hi = pos[j].repeat(width, axis=1)
    length = np.where(valid, hi - lo, 1)
    times = np.full((len(sizes), n + 1, width), INF)
    for i, b in enumerate(sizes):
        t = slot_fn(length[valid], lo[valid], np.full(int(valid.sum()), b))
        t = np.where(t <= t_cap, t, INF)
        times[i][valid] = t
    return SlotTables(pos=pos, sizes=sizes, times=times)


def prefix_dp(tables: SlotTables, thresholds: np.ndarray, with_choice: bool = False):
    """S[m, i] = least sum of slot times slicing one sequence of micro-batch size sizes[i]
    with every slice <= thresholds[m]; and, if asked, the argmin length per (m, i, j)."""
    thr = np.asarray(thresholds, dtype=np.float64)
    m, nb, n, w = len(thr), len(tables.sizes), tables.n, tables.width
    S = np.full((m, nb, n + 1), INF)
    S[:, :, 0] = 0.0
    choice = np.zeros((m, nb, n + 1), dtype=np.int64) if with_choice else None
    cap = thr[:, None, None]
    for j in range(1, n + 1):
        k = min(w, j)
        prev = S[:, :, j - k:j][:, :, ::-1]  # prev[..., kk] = S[j - 1 - kk]
        t = tables.times[:, j, :k][None]
        total = prev + np.where(t <= cap, t, INF)
        if with_choice:
            best = total.argmin(-1)
            choice[:, :, j] = best
            S[:, :, j] = np.take_along_axis(total, best[..., None], -1)[..., 0]
        else:
            S[:, :, j] = total.min(-1)
    return S[:, :, n], choice


def slicing_from_choice(pos: np.ndarray, choice_row: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Walk the argmin lengths back from L to 0: the slices in token order."""
    out = []
    j = len(pos) - 1
    while j > 0:
        i = j - int(choice_row[j]) - 1
        out.append((int(pos[i]), int(pos[j])))
        j = i
    return tuple(reversed(out))


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
           chunk: int = 16) -> DPResult | None:
    """Exact minimum of Q(batch; t_max) + (K-1) t_max over the candidate t_max values."""
    times = tables.times
    cands = np.unique(times[np.isfinite(times)])
    if len(cands) == 0:
        return None
    memo: dict[int, float] = {}

    def evaluate(idxs):
        todo = sorted({i for i in idxs if i not in memo})
        for s in range(0, len(todo), chunk):
            part = todo[s:s + chunk]
            seq_cost, _ = prefix_dp(tables, cands[part])
            q, _ = knapsack(seq_cost, tables.sizes, batch, count)
            memo.update(zip(part, q.tolist()))

    def total(i):
        return memo[i] + (K - 1) * cands[i]

    last = len(cands) - 1
    evaluate([0, last])
    best_i = min((0, last), key=total)
    best = total(best_i)
    frontier = [(0, last)]
    while frontier:
        nxt = []
        for a, b in frontier:
            if memo[b] + (K - 1) * cands[a] >= best:
                continue  # no threshold in [a, b] can beat the best
            if memo[a] == memo[b] or b - a <= 1:
                for i in (a, b):
                    if total(i) < best:
                        best, best_i = total(i), i
                continue
            nxt.append((a, b))
        evaluate([(a + b) // 2 for a, b in nxt])
        frontier = []
        for a, b in nxt:
            mid = (a + b) // 2
            frontier += [(a, mid), (mid, b)]
    if not np.isfinite(best):
        return None
    return _reconstruct(tables, K, batch, count, cands[best_i], len(cands), len(memo))


def _reconstruct(tables, K, batch, count, thr, n_cands, n_eval) -> DPResult:
    seq_cost, choice = prefix_dp(tables, np.array([thr]), with_choice=True)
    _, arg = knapsack(seq_cost, tables.sizes, batch, count)
    picks = knapsack_choice(arg, tables.sizes, batch, count)
    picks.sort(key=lambda i: -tables.sizes[i])
    mb_sizes = tuple(tables.sizes[i] for i in picks)
    slices = tuple(slicing_from_choice(tables.pos, choice[0, i]) for i in picks)
    t_sum = float(seq_cost[0, picks].sum())
    t_max = max(_slice_time(tables, i, sl) for i, sls in zip(picks, slices) for sl in sls)
    return DPResult(mb_sizes=mb_sizes, slices=slices, total=t_sum + (K - 1) * t_max,
                    t_max=t_max, candidates=n_cands, evaluated=n_eval)


def _slice_time(tables: SlotTables, size_index: int, sl: tuple[int, int]) -> float:
    i = int(np.searchsorted(tables.pos, sl[0]))
    j = int(np.searchsorted(tables.pos, sl[1]))
    return float(tables.times[size_index, j, j - i - 1])
