"""The context fit recovers known coefficients and keeps the context term non-negative."""

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


def test_needs_context_free_samples():
    with pytest.raises(ValueError, match="without context"):
        fit_curve([8, 8], [4, 8], [1.0, 2.0])
