"""Fitting measured slice times: t(l, c) = t(l, 0) + [c > 0] * (a0 + a1*l) + a2*c + a3*l*c.

The context-free part t(l, 0) is the measured curve itself (interpolated between the measured
lengths): how a device's efficiency grows with the slice length is irregular (kernel selection,
tile sizes, cache effects) and a low-degree polynomial would smooth away exactly the short-slice
overheads the optimiser must see. Below the shortest measured length the curve goes on along its
first segment, but never below the shortest slice's time per token: a shorter slice never costs
less per token.

What a context adds is simple, so four coefficients fitted by least squares capture it and let
the model price contexts that were never measured. A slice with a prefix pays once for having
one (a0 + a1*l: attention switches from its causal path to a bottom-right mask, the cache is
joined to the slice's keys and values), then for its length (a2*c + a3*l*c: attention over c
more keys). The step is only taken where c > 0, so a slice without context costs exactly what
was measured. The fit weighs every sample by its own time (relative least squares, the error it
reports), so short slices count as much as long ones.

All four coefficients are kept >= 0: a slice never gets faster because tokens precede it,
which the DP relies on when it skips slices that are too slow even without context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CurveFit:
    lengths: tuple[int, ...]  # measured slice lengths, ascending
    base: tuple[float, ...]  # median t(l, 0) at those lengths (s)
    coef: tuple[float, float, float, float]  # a0, a1 (step at c > 0), a2, a3 (growth with c)
    rel_error: float  # root-mean-square relative error of the fit over the samples

    def base_at(self, l) -> np.ndarray:
        """t(l, 0): linear between measured lengths, linear beyond them; below the shortest,
        at least that slice's time per token times l."""
        x = np.asarray(self.lengths, dtype=np.float64)
        y = np.asarray(self.base, dtype=np.float64)
        l = np.asarray(l, dtype=np.float64)
        if len(x) == 1:
            return np.maximum(y[0] * l / x[0], 0.0)
        out = np.interp(l, x, y)
        lo_slope = (y[1] - y[0]) / (x[1] - x[0])
        hi_slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        below = np.maximum(y[0] + (l - x[0]) * lo_slope, y[0] * l / x[0])
        out = np.where(l < x[0], below, out)
        out = np.where(l > x[-1], y[-1] + (l - x[-1]) * hi_slope, out)
        return np.maximum(out, 0.0)

    def __call__(self, l, c) -> np.ndarray:
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        a0, a1, a2, a3 = self.coef
        step = np.where(c > 0, a0 + a1 * l, 0.0)
        return np.maximum(self.base_at(l) + step + a2 * c + a3 * l * c, 0.0)

    def to_dict(self) -> dict:
        return {"lengths": list(self.lengths), "base": list(self.base), "coef": list(self.coef),
                "rel_error": self.rel_error}

    @classmethod
    def from_dict(cls, d: dict) -> "CurveFit":
        return cls(lengths=tuple(int(v) for v in d["lengths"]), base=tuple(float(v) for v in d["base"]),
                   coef=tuple(float(v) for v in d["coef"]), rel_error=float(d["rel_error"]))


@dataclass(frozen=True)
class StashFit:
    """Bytes one slice's forward keeps for its backward on one unit at one micro-batch size:

        s1*l + s2*l*(c+l) + [c > 0] * (s3*c + s4*l)

    s1: what every token keeps (layer inputs, norms' statistics, MLP activations, ...); s2:
    tensors of the attention's l x (c+l) shape (its mask; scores, where a path stores them);
    with a prefix, the attention also keeps the joined keys/values of all c+l tokens and this
    slice's own projections, which a first slice shares with the KV cache instead (counted
    there): s3*c + s4*l.

    A fit of what a split backward holds between its halves has a fifth coefficient, s0 bytes
    whatever the slice: the weight gradients of norms, biases and scales, handed over in the
    input half (compiler/programs/joint.py)."""

    coef: tuple  # s1, s2, s3, s4 (bytes), all >= 0; then s0 for a fit with a constant
    rel_error: float  # root-mean-square relative error of the fit over the samples

    def __call__(self, l, c) -> np.ndarray:
        l = np.asarray(l, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        s1, s2, s3, s4 = self.coef[:4]
        s0 = self.coef[4] if len(self.coef) > 4 else 0.0
        return s0 + s1 * l + s2 * l * (c + l) + np.where(c > 0, s3 * c + s4 * l, 0.0)

    def to_dict(self) -> dict:
        return {"coef": list(self.coef), "rel_error": self.rel_error}

    @classmethod
    def from_dict(cls, d: dict) -> "StashFit":
        coef = tuple(float(v) for v in d["coef"])
        if len(coef) not in (4, 5):
            raise ValueError(f"stash coefficients {list(coef)}")
        return cls(coef=coef, rel_error=float(d["rel_error"]))


def lstsq_nonneg_tail(A: np.ndarray, y: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
    """Least squares with the columns in `tail` constrained >= 0 (drop negative ones, refit)."""
    active = list(range(A.shape[1]))
    while True:
        x = np.zeros(A.shape[1])
        sol, *_ = np.linalg.lstsq(A[:, active], y, rcond=None)
        x[active] = sol
        negative = [i for i in tail if i in active and x[i] < 0]
        if not negative:
            return x
        active.remove(min(negative, key=lambda i: x[i]))


def relative_nonneg_lstsq(A: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, ...]:
    """Coefficients x >= 0 minimising sum((w * (A x - y))^2): w = 1 / (measured value) makes
    it the relative error, which every sample then weighs equally in."""
    Aw = A * w[:, None]
    # scale columns so one least-squares problem is well conditioned for any units
    scale = np.maximum(np.abs(Aw).max(axis=0), 1e-300)
    x = lstsq_nonneg_tail(Aw / scale, y * w, tail=tuple(range(A.shape[1]))) / scale
    return tuple(float(v) for v in np.maximum(x, 0.0))


def fit_curve(l, c, t) -> CurveFit:
    """Fit samples t measured at slice lengths l and contexts c (1-d arrays of equal length).

    Every measured length needs at least one sample with c = 0 (the base curve)."""
    l = np.asarray(l, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    if not (l.shape == c.shape == t.shape) or l.ndim != 1 or len(l) == 0:
        raise ValueError("l, c and t must be 1-d arrays of the same, non-zero length")
    lengths = np.unique(l)
    base = []
    for x in lengths:
        at0 = t[(l == x) & (c == 0)]
        if len(at0) == 0:
            raise ValueError(f"no sample of length {int(x)} without context")
        base.append(float(np.median(at0)))
    fit0 = CurveFit(tuple(int(x) for x in lengths), tuple(base), (0.0, 0.0, 0.0, 0.0), 0.0)
    residual = t - fit0.base_at(l)
    prefix = (c > 0).astype(np.float64)
    A = np.stack([prefix, prefix * l, c, l * c], axis=1)
    # relative: a short slice's error counts as a long one's
    coef = relative_nonneg_lstsq(A, residual, 1.0 / np.maximum(t, 1e-12))
    fit = CurveFit(fit0.lengths, fit0.base, coef, 0.0)
    pred = fit(l, c)
    rel = float(np.sqrt(np.mean(((pred - t) / np.maximum(t, 1e-12)) ** 2)))
    return CurveFit(fit.lengths, fit.base, fit.coef, rel)


def fit_stash(l, c, y, *, constant: bool = False) -> StashFit:
    """Least squares of the relative residuals (every point weighs the same, as the error is
    reported), coefficients >= 0 (a negative one is dropped and the rest refitted); with
    `constant`, StashFit's s0 too."""
    l = np.asarray(l, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if not (l.shape == c.shape == y.shape) or l.ndim != 1 or len(l) == 0:
        raise ValueError("l, c and y must be 1-d arrays of the same, non-zero length")
    prefix = (c > 0).astype(np.float64)
    columns = [l, l * (c + l), prefix * c, prefix * l] + ([np.ones_like(l)] if constant else [])
    A = np.stack(columns, axis=1)
    coef = relative_nonneg_lstsq(A, y, 1.0 / np.maximum(y, 1.0))
    fit = StashFit(coef, 0.0)
    rel = float(np.sqrt(np.mean(((fit(l, c) - y) / np.maximum(y, 1.0)) ** 2)))
    return StashFit(fit.coef, rel)
