"""The memory model, the planner and `tpc simulate` know `--shard-optimizer` (ZeRO-1): a rank
keeps 2/d of its parameters' bytes of AdamW state instead of 2x; parameters, gradients and the
rest stay; a budget between the two peaks is met only when the plan is for a sharded run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpc.cli.main import main

GPT = str(Path(__file__).resolve().parents[3] / "examples" / "gpt.py")
SHAPE = ["--stages", "2", "--dp", "2", "--microbatches", "2", "--seq-len", "64", "--batch", "8", "-q"]


def test_sharding_halves_the_optimizer_part_of_the_peak_at_dp2(tmp_path):
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.predict.sim_report import format_report
    from tpc.compiler.predict.simulate import simulate
    from tpc.ir.parse import parse

    plan_path = tmp_path / "p.tpir"
    assert main(["compile", GPT, "-o", str(plan_path), *SHAPE]) == 0
    plan = parse(plan_path.read_text(), str(plan_path))
    costs = plan_cost_model(plan.header, device_model="h100", source=str(plan_path))
    whole, sharded = simulate(plan, costs), simulate(plan, costs, shard_optimizer=True)
    for a, b in zip(whole.ranks, sharded.ranks):
        assert a.peak_memory.optimizer == 2 * a.peak_memory.params
        assert b.peak_memory.optimizer == pytest.approx(a.peak_memory.optimizer / 2)
        assert (b.peak_memory.params, b.peak_memory.grads, b.peak_memory.activations) == \
               (a.peak_memory.params, a.peak_memory.grads, a.peak_memory.activations)
    assert sharded.iteration_time == whole.iteration_time  # reduce-scatter + all-gather = allreduce
    text = format_report(sharded, "p.tpir", costs.describe())
    assert "peak memory by part (optimizer state sharded over the data-parallel group)" in text
    assert "optimizer" in text and "activations" in text


def test_a_budget_met_only_with_a_sharded_optimizer(tmp_path, capsys):
    args = ["compile", GPT, "-o", str(tmp_path / "q.tpir"), *SHAPE, "--device-model", "h100",
            "--schedule", "auto", "--memory-per-rank", "5.8MiB"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "no plan fits --memory-per-rank 5.80 MiB" in err and "--shard-optimizer" in err
    assert main([*args, "--shard-optimizer"]) == 0
