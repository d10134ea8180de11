"""`tpc profile` times a split backward's two halves apart (`StageRuntime.backward_input`, then
`backward_weight`), fits them like the backward, stores them (format version 3) and the
profiled cost model prices them; `tpc simulate` gives a plan's backward-input and
backward-weight those times. A one-layer GPT of width 16, profiled at L = 16 for micro-batch
sizes 1 and 3 (2 is priced between them)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from tpc.compiler.costmodel import ProfiledCostModel, load_cost_model
from tpc.compiler.costmodel.store import PROFILE_VERSION
from tpc.compiler.predict.memory import slice_extent
from tpc.compiler.predict.simulate import simulate
from tpc.ir.nodes import Op
from tests.compiler.costmodel.tiny_model import L, SIZES, refusals
from tests.ir.plans import simple_plan


@pytest.fixture(scope="module")
def tiny(tiny_profile):
    return tiny_profile


def test_split_fits_are_stored_and_reproduce_their_samples(tiny):
    prof = tiny["profile"]
    assert prof.version == PROFILE_VERSION and prof.num_units == 3
    for u in prof.units:
        assert len(u.bwd_input) == len(u.bwd_weight) == len(SIZES)
        assert all(len(s) == 7 and min(s[3:]) > 0 for s in u.samples)
        for k, b in enumerate(SIZES):
            pts = np.array([s[1:] for s in u.samples if s[0] == b], dtype=np.float64)
            assert len(pts) == len(u.samples) // len(SIZES)
            for fit, t in ((u.bwd_input[k], pts[:, 4]), (u.bwd_weight[k], pts[:, 5])):
                # the fit is of these samples: the lengths measured, and its stored error is
                # the error at them
                assert fit.lengths == tuple(sorted({int(v) for v in pts[:, 0]}))
                rel = (fit(pts[:, 0], pts[:, 1]) - t) / t
                assert np.sqrt(np.mean(rel ** 2)) == pytest.approx(fit.rel_error, rel=1e-9, abs=1e-12)
                # and not the plain backward's fit under another name
                assert fit != u.bwd[k]
    assert prof.worst_split_error == max(f.rel_error for u in prof.units
                                         for f in u.bwd_input + u.bwd_weight)


def test_profiled_split_sums_units_and_interpolates_sizes(tiny):
    prof = tiny["profile"]
    cm = load_cost_model(cost=str(tiny["path"]), stage_units=[(0, 2), (2, 3)])
    for stage, units in ((0, prof.units[0:2]), (1, prof.units[2:3])):
        for l, c in ((5, 0), (6, 7), (16, 0), (3, 12)):
            t_in, t_w = cm.split_backward_time(stage, l, c, 1)
            assert t_in == pytest.approx(sum(float(u.bwd_input[0](l, c)) for u in units))
            assert t_w == pytest.approx(sum(float(u.bwd_weight[0](l, c)) for u in units))
            # size 2 lies halfway between the measured 1 and 3
            mid = cm.split_backward_time(stage, l, c, 2)
            hi = cm.split_backward_time(stage, l, c, 3)
            assert mid[0] == pytest.approx((t_in + hi[0]) / 2)
            assert mid[1] == pytest.approx((t_w + hi[1]) / 2)
            # not the plain backward halved
            _, t_bwd = cm.slice_time(stage, l, c, 1)
            assert (t_in, t_w) != pytest.approx((t_bwd / 2, t_bwd / 2))


def test_a_version_2_profile_is_refused_as_stale(tiny, tmp_path):
    obj = msgpack.unpackb(tiny["path"].read_bytes(), raw=False)
    obj["version"] = 2
    for u in obj["units"]:  # what version 2 wrote: no split backward
        u.pop("bwd_input")
        u.pop("bwd_weight")
        u["samples"] = [s[:5] for s in u["samples"]]
    old = tmp_path / "v2.msgpack"
    old.write_bytes(msgpack.packb(obj, use_bin_type=True))
    for text in refusals(old):
        assert "stale" in text and "version 2" in text and f"reads version {PROFILE_VERSION}" in text
        assert "split backward" in text
        assert f"tpc profile {tiny['src']} -o {old} --seq-len {L} --batch-sizes 1,3" in text


def test_a_version_3_profile_is_refused_as_stale(tiny, tmp_path):
    """Version 3 has the same fields; its context coefficients meant something else."""
    obj = msgpack.unpackb(tiny["path"].read_bytes(), raw=False)
    obj["version"] = 3
    old = tmp_path / "v3.msgpack"
    old.write_bytes(msgpack.packb(obj, use_bin_type=True))
    for text in refusals(old):
        assert "stale" in text and "version 3" in text and "context terms" in text
        assert f"tpc profile {tiny['src']} -o {old} --seq-len {L} --batch-sizes 1,3" in text


def test_simulate_gives_split_backward_the_profiled_times(tiny):
    """A plan of the tiny model's 3 units on 3 ranks, its backward split: every backward-input
    and backward-weight costs what the profile measured for that half."""
    plan = simple_plan(3, 2, [4, 12], split_backward=True)
    cm = ProfiledCostModel(tiny["profile"], [(0, 1), (1, 2), (2, 3)])
    result = simulate(plan, cm)
    seen = {Op.BACKWARD_INPUT: 0, Op.BACKWARD_WEIGHT: 0}
    for e in result.events:
        if e.instr.op not in seen:
            continue
        seen[e.instr.op] += 1
        l, c, size = slice_extent(plan.header, e.instr)
        t_in, t_w = cm.split_backward_time(e.instr.stage, l, c, size)
        assert e.work == pytest.approx(t_in if e.instr.op is Op.BACKWARD_INPUT else t_w)
        assert e.work != pytest.approx(cm.slice_time(e.instr.stage, l, c, size)[1] / 2)
    assert seen == {Op.BACKWARD_INPUT: 12, Op.BACKWARD_WEIGHT: 12}
