"""`tpc run` in-process: the interpreter path with --verify-grads, --steps, --trace and --data;
the refusals (no torchrun, checkpoint options that cannot work, a changed model file, a world that does not
match the plan) come before any work or communication, with a message that says what to do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from tests.executors.real import model_file, real_plan
from tpc.cli.main import main
from tpc.ir.printer import print_plan


def write_plan(tmp_path: Path, name="plan.tpir", path=None, **kw) -> str:
    kw = dict(schedule="seq1f1b", stages=2, slices="2,9,5", microbatches=2) | kw
    plan = real_plan("gpt", path=path, **kw)
    out = tmp_path / name
    out.write_text(print_plan(plan), encoding="utf-8")
    return str(out)


def own_model_file(tmp_path: Path) -> Path:
    """A model file of our own (so a test may change it): the tiny GPT, imported by path."""
    f = tmp_path / "mymodel.py"
    f.write_text(
        "import importlib.util, sys\n"
        f"_spec = importlib.util.spec_from_file_location('mymodel_tiny_gpt', {model_file('gpt')!r})\n"
        "_mod = importlib.util.module_from_spec(_spec)\n"
        "sys.modules[_spec.name] = _mod\n"
        "_spec.loader.exec_module(_mod)\n"
        "model = _mod.model\n", encoding="utf-8")
    return f


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_interpret_verify_grads_and_steps(tmp_path, capsys, no_torchrun):
    plan = write_plan(tmp_path)
    assert main(["run", "--interpret", plan, "--verify-grads", "--steps", "2", "--optimizer", "sgd", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "step 1/2  loss" in out and "step 2/2  loss" in out
    assert "verify-grads:" in out and ": ok" in out


def test_verify_grads_builds_its_reference_as_the_model_file_does(tmp_path, capsys, no_torchrun):
    """minGPT-style code (tests/executors/models/tiny_mingpt.py): an MLP in a closure (a
    deepcopy's MLP would run the original's weights), `.view` of the input ids (the reference
    is fed contiguous ids) and a parameter the forward never uses (no gradient on either side:
    not an error)."""
    plan = write_plan(tmp_path, path=model_file("mingpt"), schedule="1f1b", slices="3,5,8")
    assert main(["run", "--interpret", plan, "--verify-grads", "-q"]) == 0
    out = capsys.readouterr().out
    assert "verify-grads:" in out and ": ok" in out and "inf" not in out


def test_warmup_and_clipping(tmp_path, capsys, no_torchrun):
    plan = write_plan(tmp_path)
    assert main(["run", "--interpret", plan, "--steps", "3", "--warmup", "2", "--grad-clip", "0.5",
                 "--verify-grads"]) == 0
    out = capsys.readouterr().out
    assert "step 3/3" in out and ": ok" in out  # the check is on the first step's unclipped gradients
    assert main(["run", "--interpret", plan, "--grad-clip", "-1"]) == 1
    assert "--grad-clip must be >= 0" in capsys.readouterr().err


def test_metrics_file(tmp_path, no_torchrun):
    from tpc.executors.training.lr import lr_at

    plan = write_plan(tmp_path)
    metrics = tmp_path / "m.jsonl"
    assert main(["run", "--interpret", plan, "--steps", "3", "--warmup", "2", "--lr", "0.01",
                 "--metrics", str(metrics), "-q"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == [lr_at(s, peak=0.01, warmup=2, total=3) for s in range(3)]
    assert all(r["grad_norm"] > 0 and r["loss"] > 0 and r["step_time"] > 0 for r in rows)
    # the first step's norm is the whole model's, a tied weight counted once
    from tests.executors.real import fresh_model
    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.oracle import batch_reference

    grads = batch_reference(fresh_model("gpt")[0], RandomTokens(0, 4, 16, 256).get(0)).grads
    norm = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    assert rows[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_verify_grads_fails_above_tolerance(tmp_path, capsys, no_torchrun):
    plan = write_plan(tmp_path)
    # sliced attention adds and multiplies in another order: errors of ~1e-7, never 0
    assert main(["run", "--interpret", plan, "--verify-grads", "--tolerance", "1e-12", "-q"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_trace_is_chrome_json(tmp_path, no_torchrun):
    plan = write_plan(tmp_path)
    trace = tmp_path / "trace.json"
    assert main(["run", "--interpret", plan, "--trace", str(trace), "-q"]) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    lines = Path(plan).read_text().splitlines()
    assert {e["pid"] for e in events} == {0, 1}
    for e in events:
        assert e["dur"] >= 0 and e["args"]["rank"] == e["pid"]
        assert lines[e["args"]["line"] - 1].strip() == e["args"]["instr"] == e["name"]
    # the format of `tpc simulate --trace`, which `tpc simulate --compare` reads
    from tpc.compiler.costmodel.unit import UnitCosts
    from tpc.compiler.predict.chrome_trace import read_trace
    from tpc.compiler.predict.simulate import simulate
    from tpc.compiler.predict.timeline import compare, predicted_trace
    from tpc.ir.verify import verify_file

    result = simulate(verify_file(plan), UnitCosts())
    predicted = [e for e in predicted_trace(result, plan)["traceEvents"] if e["ph"] == "X"]
    assert {tuple(sorted(e)) for e in events} == {tuple(sorted(e)) for e in predicted}
    assert {tuple(sorted(e["args"])) for e in events} == {tuple(sorted(e["args"])) for e in predicted}
    assert len(compare(result, read_trace(str(trace))).rows) == 1 + len(result.ranks)


def test_token_file_data(tmp_path, capsys, no_torchrun):
    plan = write_plan(tmp_path)
    tokens = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(tokens)
    assert main(["run", "--interpret", plan, "--data", str(tokens), "--verify-grads"]) == 0
    assert ": ok" in capsys.readouterr().out


def test_without_torchrun_or_interpret(tmp_path, capsys, no_torchrun):
    plan = write_plan(tmp_path)
    assert main(["run", plan]) == 1
    err = capsys.readouterr().err
    assert "torchrun" in err and "--interpret" in err


@pytest.mark.parametrize("option, message", [
    (["--save-every", "3"], "--save-every needs --checkpoint-dir"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-dir", "ck", "--save-every", "-1"], "--save-every must be >= 0"),
    (["--checkpoint-dir", "ck", "--resume", "--verify-grads"], "a resumed run does not start there"),
    (["--checkpoint-dir", "nowhere", "--resume"], "--resume: no complete checkpoint in nowhere"),
])
def test_checkpoint_options_are_checked_before_any_work(tmp_path, capsys, no_torchrun, monkeypatch, option, message):
    plan = write_plan(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--interpret", plan, "-q", *option]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_changed_model_file_is_refused(tmp_path, capsys, monkeypatch):
    model = own_model_file(tmp_path)
    plan = write_plan(tmp_path, path=str(model), stages=2)
    with model.open("a") as f:
        f.write("# an edit after compiling\n")
    for env in ({}, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = ["run", plan] if env else ["run", "--interpret", plan]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert "has changed since the plan was compiled" in err and "recompile" in err
    assert not dist.is_initialized()  # refused before any communication


def test_a_trace_that_cuts_other_units_is_refused(tmp_path, capsys, monkeypatch):
    """A re-trace that finds another number of partition units than the plan's `units` line (a
    torch upgrade that moved a unit boundary) is refused at that line, in both executors, before
    any communication. The plan here says 5 units of a model that traces to 4."""
    plan = Path(write_plan(tmp_path, stages=2))
    text = plan.read_text(encoding="utf-8")
    assert "\nunits 4\n" in text and " units 2:4 " in text
    plan.write_text(text.replace("\nunits 4\n", "\nunits 5\n").replace(" units 2:4 ", " units 2:5 "),
                    encoding="utf-8")
    line = plan.read_text(encoding="utf-8").splitlines().index("units 5") + 1
    for env in ({}, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = ["run", str(plan)] if env else ["run", "--interpret", str(plan)]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert "compiled for 5 partition units" in err and "now traces to 4" in err, err
        assert f"{plan}:{line}" in err and "recompile" in err
    assert not dist.is_initialized()


def test_wrong_world_size_is_refused(tmp_path, capsys, monkeypatch):
    plan = write_plan(tmp_path, stages=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["run", plan]) == 1
    err = capsys.readouterr().err
    assert "the plan needs 2 processes (mesh pipe 2 data 1), but torchrun started 3" in err
    assert "--nproc-per-node 2" in err
    assert f"{plan}:" in err  # located at the plan's mesh line
    assert not dist.is_initialized()
