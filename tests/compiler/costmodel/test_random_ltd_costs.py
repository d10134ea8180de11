"""Random-LTD in the cost model: a dropped unit is priced at its kept tokens (its matmuls at f,
its causal attention at f^2, plus the gather and scatter of the residual stream), at the
schedule's mean kept fraction; with `--device-model h100` the plan search moves the stage
boundaries when most middle units of a wide model drop half their tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.executors.real import model_file, traced
from tpc.compiler.costmodel.dropped import DroppedUnitCostFn
from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts
from tpc.compiler.costmodel.devices import PRESETS as DEVICES
from tpc.compiler.random_ltd import RandomLTD

WIDE = str(Path(__file__).resolve().parents[3] / "bench" / "models" / "long_nanogpt.py")


def test_priced_fraction_is_the_mean_kept_count_of_the_ramp():
    ltd = RandomLTD(units=(1,), min_value=4, max_value=12, require_steps=4, seq_per_step=2)
    # kept over steps 0..3: 4, 6, 8, 10 -> mean 7 of 16
    assert [ltd.kept(s) for s in range(4)] == [4, 6, 8, 10]
    assert ltd.priced_fraction(16) == pytest.approx(7 / 16)
    # capped at the plan's length (a shorter plan of a curriculum bundle)
    assert ltd.priced_fraction(8) == pytest.approx((4 + 6 + 8 + 8) / 4 / 8)
    assert RandomLTD(units=(1,), min_value=8, max_value=8, require_steps=1).fractions(16) == {1: 0.5}


def test_a_dropped_unit_costs_its_kept_tokens():
    _, sliced, _ = traced(model_file("nanogpt"), 16)
    fn = sliced.unit_cost_fns(2)[1]
    half = DroppedUnitCostFn(fn, 0.5, sliced.hidden_size, 2)
    l, b = np.array([64.0, 256.0]), 2
    full, kept = fn(l, 0, b), half(l, 0, b)
    assert np.allclose(kept.fwd["matmul"].flops, full.fwd["matmul"].flops / 2)
    assert np.allclose(kept.bwd["matmul"].flops, full.bwd["matmul"].flops / 2)
    assert np.all(kept.fwd["attention"].flops < full.fwd["attention"].flops / 2)  # ~ f^2 (plus f terms)
    moved = (2 * l + 3 * l * 0.5) * b * sliced.hidden_size * 2
    assert np.allclose(kept.fwd["memory"].bytes, fn(l * 0.5, 0, b).fwd["memory"].bytes + moved)
    assert half.signature != fn.signature
    costs = GraphCosts.from_sliced(sliced, kept={1: 0.5})
    plain = GraphCosts.from_sliced(sliced)
    assert costs.kv_elements[1] == plain.kv_elements[1] / 2 and costs.kv_elements[2] == plain.kv_elements[2]
    model = GraphCostModel(DEVICES["h100"], costs, [(0, 1), (1, 2), (2, 4)])
    assert "random-LTD keeping 50% in unit 1" in model.describe()


def test_the_partition_follows_the_dropped_units():
    """8 blocks of width 2048 at 8192 tokens on h100 (`tpc compile ... --device-model h100`):
    units 1-5 keeping half their tokens move the stage boundaries toward the last blocks."""
    from tpc.compiler.options import check_options
    from tpc.compiler.passes import CompileState
    from tpc.compiler.pipeline import compile_passes

    base = dict(seq_len=8192, batch=4, stages=4, microbatches=2, slices=1, schedule="1f1b", device_model="h100",
                factory="wide")
    plain = compile_passes(check_options(**base))
    dropping = compile_passes(check_options(**base, random_ltd=RandomLTD(
        units=(1, 2, 3, 4, 5), min_value=4096, max_value=4096, require_steps=1)))
    state = CompileState(model_path=WIDE, factory="wide")
    for p in plain[:2]:  # load and trace, shared
        assert p.name in ("load", "trace")
        state = p.run(state, lambda _: None)
    found = {}
    for name, passes in (("plain", plain), ("dropping", dropping)):
        s = state
        for p in passes[2:4]:  # costs, search
            assert p.name in ("costs", "search")
            s = p.run(s, lambda _: None)
        found[name] = tuple(st.units for st in s.header.stages)
        assert (s.header.random_ltd is not None) == (name == "dropping")
    assert found["plain"] == ((0, 3), (3, 5), (5, 7), (7, 10))
    assert found["dropping"] == ((0, 5), (5, 7), (7, 8), (8, 10))
