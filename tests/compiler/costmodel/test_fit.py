"""The context fit recovers known coefficients, leaves context-free slices at their measured
times, keeps every context term non-negative, and never prices a slice shorter than the
measured ones below their time per token."""

from __future__ import annotations

import numpy as np
import pytest

from tpc.compiler.costmodel.fit import CurveFit, fit_curve


def grid(L=512):
    ls, cs = [], []
    for l in (32, 64, 128, 256, 512):
        for c in sorted({0, (L - l) // 2, L - l}):
            ls.append(l)
            cs.append(c)
    return np.array(ls, float), np.array(cs, float)


def test_recovers_known_context_coefficients():
    l, c = grid()
    base = 1e-3 + 2e-4 * np.sqrt(l)  # an irregular context-free curve
    a2, a3 = 3e-6, 4e-8
    t = base + a2 * c + a3 * l * c
    fit = fit_curve(l, c, t)
    assert fit.coef[2] == pytest.approx(a2, rel=1e-6)
    assert fit.coef[3] == pytest.approx(a3, rel=1e-6)
    assert abs(fit.coef[0]) < 1e-12 and abs(fit.coef[1]) < 1e-14
    assert fit.rel_error < 1e-9
    # the context part at a point never measured is exact; the base is interpolated
    assert fit(200, 100) - fit(200, 0) == pytest.approx(a2 * 100 + a3 * 200 * 100, rel=1e-6)
    assert fit(200, 0) == pytest.approx(1e-3 + 2e-4 * np.sqrt(200), rel=2e-2)  # chord of a sqrt


def test_noisy_data_reports_its_error():
    rng = np.random.default_rng(0)
    l, c = grid()
    t = 1e-3 + 1e-6 * l + 2e-6 * c
    noisy = t * (1 + 0.05 * rng.standard_normal(len(t)))
    fit = fit_curve(l, c, noisy)
    assert 0.005 < fit.rel_error < 0.2
    assert fit.coef[2] == pytest.approx(2e-6, rel=0.5)


def test_context_term_is_never_negative():
    l, c = grid()
    t = 1e-3 + 1e-6 * l - 1e-7 * c  # a (noisy) profile that gets faster with context
    fit = fit_curve(l, c, t)
    assert fit.coef[2] >= 0 and fit.coef[3] >= 0
    assert np.all(np.diff(fit(128, np.arange(0, 400, 50))) >= 0)


def test_base_curve_interpolates_and_extrapolates():
    fit = CurveFit(lengths=(10, 20, 40), base=(1.0, 2.0, 3.0), coef=(0, 0, 0, 0), rel_error=0)
    assert fit.base_at(15) == pytest.approx(1.5)
    assert fit.base_at(80) == pytest.approx(5.0)  # slope of the last segment
    assert fit.base_at(0) == pytest.approx(0.0)
    assert CurveFit.from_dict(fit.to_dict()) == fit


def test_below_the_shortest_length_a_token_costs_at_least_what_it_did_there():
    # a steep first segment: going on along it would reach zero at l = 16
    fit = CurveFit(lengths=(32, 64), base=(1.0, 3.0), coef=(0, 0, 0, 0), rel_error=0)
    for l in (1, 8, 16, 24):
        assert fit.base_at(l) == pytest.approx(l / 32)
    # a shallow one (a fixed cost per slice): the segment, which lies above
    fit = CurveFit(lengths=(32, 64), base=(1.0, 1.5), coef=(0, 0, 0, 0), rel_error=0)
    assert fit.base_at(16) == pytest.approx(0.75)


def test_a_step_for_having_a_prefix_leaves_context_free_slices_as_measured():
    """Attention with a prefix takes another path (a mask, the cache joined to the slice):
    a step at c > 0 that the context-free samples must not absorb."""
    l, c = grid()
    base = 2e-4 + 1e-5 * l
    step = np.where(c > 0, 3e-4 + 2e-6 * l, 0.0)
    t = base + step + 1e-7 * c + 2e-9 * l * c
    fit = fit_curve(l, c, t)
    assert fit.coef == pytest.approx((3e-4, 2e-6, 1e-7, 2e-9), rel=1e-6)
    assert fit.rel_error < 1e-9
    for x in (32, 64, 128, 256, 512):
        assert fit(x, 0) == pytest.approx(2e-4 + 1e-5 * x, rel=1e-9)


def test_context_free_samples_stay_as_measured_whatever_the_context_does():
    """A context cost the model cannot express (growing as sqrt(c)) is fitted as well as it
    can be at c > 0; the slices without context keep their measured medians."""
    l, c = grid()
    t = 1e-3 + 1e-5 * l + 4e-5 * np.sqrt(c) * (l / 64)
    fit = fit_curve(l, c, t)
    for x in (32, 64, 128, 256, 512):
        assert fit(x, 0) == pytest.approx(1e-3 + 1e-5 * x, rel=1e-9)
    assert all(v >= 0 for v in fit.coef)


def test_short_slices_weigh_as_much_as_long_ones():
    """Relative least squares: a step that is large next to short slices' times and small
    next to long ones' is fitted where it matters, at the short slices."""
    l, c = grid()
    t = 1e-4 * l + np.where(c > 0, 2e-3, 0.0) + 1e-6 * c * (l == 512)  # an outlier at the longest
    fit = fit_curve(l, c, t)
    short = (l == 32) & (c > 0)
    assert np.all(np.abs(fit(l[short], c[short]) / t[short] - 1) < 0.05)


def test_needs_context_free_samples():
    with pytest.raises(ValueError, match="without context"):
        fit_curve([8, 8], [4, 8], [1.0, 2.0])
