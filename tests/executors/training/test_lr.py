import math

import pytest

from tpc.executors.training.lr import lr_at
from tpc.ir.diagnostics import TpirError


def test_warmup_is_linear_from_zero_and_reaches_peak():
    vals = [lr_at(s, peak=1.0, warmup=4, total=20) for s in range(4)]
    assert vals == [0.25, 0.5, 0.75, 1.0]


def test_decay_starts_at_peak_and_ends_at_floor():
    assert lr_at(4, peak=2.0, warmup=4, total=20, min_ratio=0.1) == pytest.approx(2.0)
    assert lr_at(20, peak=2.0, warmup=4, total=20, min_ratio=0.1) == pytest.approx(0.2)
    assert lr_at(1000, peak=2.0, warmup=4, total=20, min_ratio=0.1) == pytest.approx(0.2)


def test_cosine_midpoint_is_halfway_between_peak_and_floor():
    # progress 1/2 of the decay: cos(pi/2) = 0
    assert lr_at(12, peak=1.0, warmup=4, total=20, min_ratio=0.0) == pytest.approx(0.5)
    step = 8  # progress 1/4
    expect = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_at(step, peak=1.0, warmup=4, total=20) == pytest.approx(expect)


def test_decay_is_monotone():
    vals = [lr_at(s, peak=1.0, warmup=3, total=30) for s in range(3, 40)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert vals[0] > vals[-1]


def test_total_zero_is_constant_after_warmup():
    assert [lr_at(s, peak=0.5, warmup=2, total=0) for s in range(5)] == [0.25, 0.5, 0.5, 0.5, 0.5]
    assert lr_at(0, peak=0.5, warmup=0, total=0) == 0.5


def test_no_warmup_starts_at_peak():
    assert lr_at(0, peak=1.0, warmup=0, total=10) == pytest.approx(1.0)


@pytest.mark.parametrize("kw", [dict(peak=0.0, warmup=0, total=0), dict(peak=1.0, warmup=-1, total=0),
                                dict(peak=1.0, warmup=10, total=5), dict(peak=1.0, warmup=0, total=5, min_ratio=2.0)])
def test_bad_settings_are_refused_with_a_hint(kw):
    with pytest.raises(TpirError) as e:
        lr_at(0, **kw)
    assert "hint:" in str(e.value)
