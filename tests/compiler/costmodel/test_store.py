"""Profiles round-trip through msgpack; stale and foreign profiles are refused with a hint."""

from __future__ import annotations

import pytest

from tpc.compiler.costmodel import ProfiledCostModel, load_cost_model
from tpc.compiler.costmodel.fit import CurveFit
from tpc.compiler.costmodel.store import Profile, UnitProfile, load_profile, save_profile
from tpc.ir.diagnostics import TpirError


def fake_profile(sha="a" * 64, device="cpu:test") -> Profile:
    def curve(scale):
        return CurveFit(lengths=(8, 16, 32), base=(1e-3 * scale, 1.5e-3 * scale, 2.5e-3 * scale),
                        coef=(0.0, 0.0, 1e-6, 1e-8), rel_error=0.01)

    units = tuple(UnitProfile(label=f"u{i}", fwd=(curve(1), curve(1.8)), bwd=(curve(2), curve(3.6)),
                              kv_bytes_per_token=128 * (0 < i < 3), param_bytes=1000 + i,
                              samples=((1, 8, 0, 1e-3, 2e-3),))
                  for i in range(4))
    return Profile(model_path="m.py", model_sha256=sha, factory="model", device=device, seq_len=32,
                   hidden=16, batch_sizes=(1, 2), units=units, act_bytes_per_token=64,
                   link_latency=5e-5, link_bandwidth=2e9)


def test_round_trip(tmp_path):
    p = fake_profile()
    path = tmp_path / "c.msgpack"
    save_profile(p, path)
    assert load_profile(path, model_sha256="a" * 64, device="cpu:test") == p


def test_stale_profile_is_refused(tmp_path):
    path = tmp_path / "c.msgpack"
    save_profile(fake_profile(), path)
    with pytest.raises(TpirError) as e:
        load_profile(path, model_sha256="b" * 64)
    text = str(e.value)
    assert "stale" in text and "tpc profile m.py" in text and "hint" in text


def test_foreign_profile_is_refused(tmp_path):
    path = tmp_path / "c.msgpack"
    save_profile(fake_profile(), path)
    with pytest.raises(TpirError) as e:
        load_profile(path, device="cuda:NVIDIA H100")
    assert "measured on 'cpu:test'" in str(e.value) and "--device-model" in str(e.value)


def test_garbage_and_missing_files(tmp_path):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x00\x01not msgpack")
    with pytest.raises(TpirError, match="not a cost profile"):
        load_profile(bad)
    with pytest.raises(TpirError, match="no such cost profile"):
        load_profile(tmp_path / "none.msgpack")


def test_profiled_model_sums_units_and_interpolates_batch(tmp_path):
    path = tmp_path / "c.msgpack"
    save_profile(fake_profile(), path)
    cm = load_cost_model(cost=str(path), stage_units=[(0, 2), (2, 4)])
    assert isinstance(cm, ProfiledCostModel) and cm.num_stages == 2
    f1, b1 = cm.slice_time(0, 16, 0, 1)
    assert f1 == pytest.approx(2 * 1.5e-3) and b1 == pytest.approx(2 * 3e-3)
    f2, _ = cm.slice_time(0, 16, 0, 2)
    f15, _ = cm.slice_time(0, 16, 0, 3)  # beyond the measured sizes: proportional to rows
    assert f2 == pytest.approx(2 * 1.5e-3 * 1.8) and f15 == pytest.approx(f2 * 1.5)
    assert cm.slice_time(0, 16, 8, 1)[0] > f1  # context adds time
    assert cm.kv_bytes(0, 10, 2) == 128 * 10 * 2 and cm.param_bytes(1) == 1002 + 1003
    assert cm.p2p_time(2e9) == pytest.approx(1 + 5e-5)


def test_load_cost_model_needs_exactly_one_source(tmp_path):
    with pytest.raises(TpirError, match="no cost model"):
        load_cost_model()
    with pytest.raises(TpirError, match="both given"):
        load_cost_model(cost="x", device_model="v100")


def test_fit_error_is_reported_as_a_share_of_the_model_time():
    """A tiny unit fitted 4x off its own time (0.1 ms measured, 0.5 ms fitted) beside a 10 ms
    unit fitted exactly: the profile's error is 0.4 ms of a 10.1 ms point, not 400%, and that is
    what `tpc simulate`'s report line says."""
    def flat(t: float, err: float) -> tuple:
        return (CurveFit(lengths=(8, 16), base=(t, t), coef=(0.0, 0.0, 0.0, 0.0), rel_error=err),)

    big = UnitProfile("big", fwd=flat(5e-3, 0.0), bwd=flat(5e-3, 0.0), kv_bytes_per_token=0,
                      param_bytes=1, samples=((1, 8, 0, 5e-3, 5e-3), (1, 16, 0, 5e-3, 5e-3)))
    tiny = UnitProfile("tiny", fwd=flat(0.5e-3, 4.0), bwd=flat(0.05e-3, 0.0), kv_bytes_per_token=0,
                       param_bytes=1, samples=((1, 8, 0, 0.1e-3, 0.05e-3), (1, 16, 0, 0.1e-3, 0.05e-3)))
    prof = Profile(model_path="m.py", model_sha256="0" * 64, factory="model", device="cpu",
                   seq_len=16, hidden=8, batch_sizes=(1,), units=(big, tiny), act_bytes_per_token=32,
                   link_latency=0.0, link_bandwidth=1e9)
    assert prof.worst_fit_error == 4.0  # per fit, relative to its own time
    assert prof.fit_error_share() == pytest.approx(0.4e-3 / 10.15e-3)
    line = ProfiledCostModel(prof, [(0, 2)]).describe()
    assert "fits within 3.94% of the model's time" in line and "400" not in line
