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
