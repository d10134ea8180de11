"""Sanity of the analytic model, device specs, and the profiler end to end on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tpc.compiler.costmodel import AnalyticCostModel, ModelShapes, even_layers, load_cost_model
from tpc.compiler.costmodel.devices import V100, load_device_spec
from tpc.compiler.costmodel.store import load_profile
from tpc.ir.diagnostics import TpirError
from tests.compiler.costmodel.tiny_model import write_tiny_gpt

GPT3_13B = ModelShapes(layers=40, hidden=5120, heads=40, vocab=50257)


def model(op=1, stages=40):
    return AnalyticCostModel(V100, GPT3_13B, even_layers(40, stages), op=op)


def total(cm, l, c=0, b=1, stage=1):
    f, bw = cm.slice_time(stage, l, c, b)
    return f + bw


def test_longer_slices_and_more_context_take_longer():
    cm = model()
    times = [total(cm, l) for l in (8, 64, 256, 1024, 2048)]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert total(cm, 128, c=1024) > total(cm, 128, c=0)
    assert total(cm, 128, b=4) > total(cm, 128, b=1)


def test_short_slices_lose_efficiency_per_token():
    cm = model()
    per_token = [total(cm, l) / l for l in (8, 32, 128, 512, 2048)]
    assert all(a > b for a, b in zip(per_token, per_token[1:]))
    # a 2048-token slice runs its matmuls near the compute roof: close to FLOPs / achieved rate
    h, L = 5120, 2048
    flops = 3 * (24 * L * h * h + 4 * L * L * h)
    ideal = flops / (V100.peak_flops * V100.flops_efficiency)
    assert ideal < total(cm, L) < 1.5 * ideal


def test_backward_costs_about_twice_forward():
    f, b = model().slice_time(1, 1024, 0, 1)
    assert 1.8 < b / f < 2.6


def test_operator_parallelism_divides_compute_and_adds_allreduce():
    one, eight = model(op=1), model(op=8)
    assert total(eight, 2048) < total(one, 2048) / 4
    assert total(eight, 2048) > total(one, 2048) / 8  # the all-reduces are not free
    assert eight.param_bytes(1) == pytest.approx(one.param_bytes(1) / 8, rel=1e-3)


def test_first_and_last_stage_carry_embedding_and_head():
    cm = model()
    assert total(cm, 256, stage=39) > total(cm, 256, stage=1)
    assert cm.param_bytes(0) > cm.param_bytes(1)
    assert cm.distinct_stages() == (0, 1, 39)


def test_vectorised_times_match_scalar():
    cm = model(op=8)
    l = np.array([8, 64, 512])
    c = np.array([0, 100, 1000])
    f, b = cm.slice_times(1, l, c, 2)
    for i in range(3):
        assert (f[i], b[i]) == pytest.approx(cm.slice_time(1, int(l[i]), int(c[i]), 2))


def test_gradient_sync_shares_the_node_link_at_the_collective_efficiency():
    import dataclasses
    cm = model(stages=40)
    assert cm.grad_sync_time(1, 1) == 0.0
    # ring all-reduce: 2 (d-1)/d of the bytes, 8 GPUs of a node on one link, at 60% of line rate
    d = 4
    expect = (2 * (d - 1) * V100.inter_node_latency + 2 * (d - 1) / d * cm.param_bytes(1) * 8
              / (V100.inter_node_bandwidth * V100.collective_efficiency))
    assert cm.grad_sync_time(1, d) == pytest.approx(expect)
    full = dataclasses.replace(V100, collective_efficiency=1.0)
    faster = AnalyticCostModel(full, GPT3_13B, even_layers(40, 40)).grad_sync_time(1, d)
    assert faster < cm.grad_sync_time(1, d)
    with pytest.raises(ValueError, match="efficiencies"):
        dataclasses.replace(V100, collective_efficiency=1.5)


def test_device_spec_from_file_and_errors(tmp_path):
    spec = tmp_path / "gpu.json"
    spec.write_text(json.dumps({"name": "mygpu", "peak_flops": 1e14, "mem_bandwidth": 1e12}))
    assert load_device_spec(str(spec)).peak_flops == 1e14
    assert load_device_spec("H100").name == "h100"
    with pytest.raises(TpirError, match="unknown device model"):
        load_device_spec("tpu9")
    spec.write_text(json.dumps({"peak_flops": 1e14, "mem_bandwidth": 1e12, "speed": 3}))
    with pytest.raises(TpirError, match="unknown device spec field"):
        load_device_spec(str(spec))
    spec.write_text(json.dumps({"peak_flops": -1, "mem_bandwidth": 1e12}))
    with pytest.raises(TpirError, match="bad device spec"):
        load_device_spec(str(spec))


def test_load_cost_model_maps_units_to_layers():
    shapes = ModelShapes(layers=4, hidden=64, heads=4, vocab=100)
    cm = load_cost_model(device_model="a100", model_shapes=shapes, stage_units=[(0, 3), (3, 6)],
                         num_units=6)
    assert cm.stage_layers == (2, 2)
    with pytest.raises(TpirError, match="layers"):
        load_cost_model(device_model="a100", model_shapes=shapes, stage_units=[(0, 2), (2, 4)],
                        num_units=4)


def test_profile_a_tiny_model_end_to_end(tmp_path, repo_root):
    src = write_tiny_gpt(tmp_path / "tiny.py", repo_root)
    out = tmp_path / "tiny.msgpack"
    from tpc.cli.main import main
    assert main(["profile", str(src), "-o", str(out), "--seq-len", "16", "--batch-sizes", "1,2"]) == 0
    from tpc.compiler.frontend import file_sha256
    from tpc.executors.profile import device_name
    prof = load_profile(out, model_sha256=file_sha256(str(src)), device=device_name("cpu"))
    assert prof.num_units == 3 and prof.batch_sizes == (1, 2)
    assert all(s[3] > 0 and s[4] > 0 for u in prof.units for s in u.samples)
    assert prof.units[1].kv_bytes_per_token == 2 * 16 * 4  # K and V rows of one fp32 layer
    src.write_text(src.read_text() + "\n# edited\n")
    with pytest.raises(TpirError, match="stale"):
        load_profile(out, model_sha256=file_sha256(str(src)))


def test_profile_cli_rejects_bad_batch_sizes(tmp_path, capsys):
    from tpc.cli.main import main
    assert main(["profile", "nonexistent.py", "-o", str(tmp_path / "x"), "--seq-len", "16",
                 "--batch-sizes", "1,x"]) == 1
    assert "--batch-sizes" in capsys.readouterr().err
