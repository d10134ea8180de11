"""Stopping and resuming a `tpc run` changes nothing: a run stopped at step 20 and resumed to 30
logs exactly the losses (and rates) of the run that was never stopped, in the interpreter and in
two gloo processes; a process killed in the middle of a save (shards written, directory not yet
renamed) leaves the previous checkpoint, which resumes to the same losses; and the exported
state_dict computes what the pipelined model computes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.executors.dist_harness import launch
from tests.executors.training.run_helpers import (PLAN, TRAIN, batches, initial_model, metrics, plain_training, run_cli_rank,
                                        stopping_after, write_plan, write_tokens)
from tests.executors.training.test_train_vs_pytorch import check_against_plain
from tpc.cli.main import main
from tpc.executors.training import checkpoint
from tpc.executors.training.checkpoint import latest_checkpoint, read_meta

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    return write_plan(d), write_tokens(d)


def _run(plan, data, ck, out, steps, *extra, interpret=True):
    return ["run", *(["--interpret"] if interpret else []), plan, "--steps", str(steps), "--data", data, *TRAIN,
            "--checkpoint-dir", str(ck), "--save-every", "10", "--metrics", str(out), "-q", *extra]


@pytest.fixture(scope="module")
def uninterrupted(files, tmp_path_factory):
    """The 30-step interpreter run that is never stopped: its metrics and checkpoint root."""
    plan, data = files
    d = tmp_path_factory.mktemp("whole")
    assert main(_run(plan, data, d / "ck", d / "m.jsonl", 30)) == 0
    return metrics(d / "m.jsonl"), d / "ck"


def _same_run(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert (g["step"], g["loss"], g["lr"], g["grad_norm"]) == (w["step"], w["loss"], w["lr"], w["grad_norm"])


def test_stop_at_20_and_resume_to_30_is_the_uninterrupted_run(files, uninterrupted, tmp_path, monkeypatch):
    plan, data = files
    ck, out = tmp_path / "ck", tmp_path / "m.jsonl"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save_checkpoint", stopping_after(20))
        assert main(_run(plan, data, ck, out, 30)) == 130  # interrupted just after checkpoint 20
    assert [r["step"] for r in metrics(out)] == list(range(1, 21))
    assert latest_checkpoint(ck).name == "step_000020" and read_meta(ck)["step"] == 20
    assert main(_run(plan, data, ck, out, 30, "--resume")) == 0
    _same_run(metrics(out), uninterrupted[0])
    # the final weights are the uninterrupted run's, bit for bit
    from tpc.executors.training.export import export_state_dict

    mine, _ = export_state_dict(ck)
    theirs, _ = export_state_dict(uninterrupted[1])
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


KILL_DURING_SAVE = """
import os, sys
from tpc.executors.training import checkpoint
real_publish = checkpoint._publish
def publish(root, tmp, final):
    if final.name == "step_000020":  # every shard and tpc.json are written; the rename is next
        os._exit(9)
    real_publish(root, tmp, final)
checkpoint._publish = publish
from tpc.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_during_a_save_leaves_a_checkpoint_that_resumes(files, uninterrupted, tmp_path):
    plan, data = files
    ck, out = tmp_path / "ck", tmp_path / "m.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *_run(plan, data, ck, out, 30)],
                          capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=120, cwd=ROOT)
    assert done.returncode == 9, done.stderr[-2000:]
    half = ck / ".tmp_step_000020"
    assert (half / "tpc.json").is_file() and any(half.glob("*.distcp"))  # killed after writing, before renaming
    assert (ck / "latest").read_text().strip() == "step_000010" and latest_checkpoint(ck).name == "step_000010"
    assert len(metrics(out)) == 20  # it logged 20 steps, 10 of them after its last complete checkpoint

    assert main(_run(plan, data, ck, out, 30, "--resume")) == 0
    _same_run(metrics(out), uninterrupted[0])  # steps 11..20 ran again, and are logged once
    assert not half.exists() and latest_checkpoint(ck).name == "step_000030"


def test_two_gloo_ranks_stop_and_resume(files, tmp_path):
    """Two processes (gloo) interrupted after the checkpoint at step 5 and resumed to 10: every
    loss is plain PyTorch's within 1e-4, and exactly the interpreter's run that was never stopped
    (two ranks add their parts in either order to the same float)."""
    plan, data = files
    whole = tmp_path / "whole"
    assert main(_run(plan, data, whole / "ck", whole / "m.jsonl", 10)) == 0
    argv = ["run", plan, "--steps", "10", "--data", data, *TRAIN, "--checkpoint-dir", str(tmp_path / "ck"),
            "--save-every", "5", "--metrics", str(tmp_path / "m.jsonl"), "-q", "--timeout", "60"]
    codes, errs = launch(2, tmp_path, run_cli_rank, argv, 5, limit=120)
    assert codes == [130, 130], errs
    assert latest_checkpoint(tmp_path / "ck").name == "step_000005"
    step5 = tmp_path / "ck" / "step_000005"
    assert sorted(p.name for p in step5.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard per rank
    codes, errs = launch(2, tmp_path, run_cli_rank, argv + ["--resume"], limit=120)
    assert codes == [0, 0], errs
    rows = metrics(tmp_path / "m.jsonl")
    plain, _ = plain_training(data, 10, total=10)
    check_against_plain(rows, plain, total=10)
    _same_run(rows, metrics(whole / "m.jsonl"))


def test_resume_refuses_another_model_at_the_plan_model_line(files, uninterrupted, tmp_path, capsys):
    from tests.executors.real import real_plan
    from tpc.ir.printer import print_plan

    plan, data = files
    other = tmp_path / "other.tpir"
    other.write_text(print_plan(real_plan("gpt_nobias", **PLAN)), encoding="utf-8")
    ck = tmp_path / "ck"
    shutil.copytree(uninterrupted[1], ck)
    before = sorted(p.name for p in ck.iterdir())
    assert main(_run(str(other), data, ck, tmp_path / "m.jsonl", 40, "--resume")) == 1
    err = capsys.readouterr().err
    assert f"{other}:2:1: error: --resume: {ck / 'step_000030'} was written by a run of another model: " in err
    assert "tiny_gpt.py (factory model, sha256 " in err and "this plan's model is " in err and "tiny_gpt_nobias.py" in err
    assert "use --init-from" in err  # how to start from its weights anyway
    assert sorted(p.name for p in ck.iterdir()) == before and not (tmp_path / "m.jsonl").exists()  # nothing trained
    # and a run that would end before the checkpoint's step says so
    assert main(_run(plan, data, ck, tmp_path / "m.jsonl", 20, "--resume")) == 1
    assert "is at step 30, past --steps 20" in capsys.readouterr().err


def test_export_computes_what_the_pipeline_computes(files, uninterrupted, tmp_path):
    """The exported state_dict in a fresh model: its loss on the batch of step 30 is the loss the
    pipelined model reports for that step (resumed for one more step), and its logits are plain
    training's after 30 steps."""
    plan, data = files
    ck = tmp_path / "ck"
    shutil.copytree(uninterrupted[1], ck)
    assert main(["export", str(ck), "-o", str(tmp_path / "gpt.pt")]) == 0
    model = initial_model()
    model.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True), strict=True)
    out = tmp_path / "m.jsonl"
    assert main(_run(plan, data, ck, out, 31, "--resume")) == 0
    pipelined = metrics(out)[-1]
    assert pipelined["step"] == 31
    tokens = batches(data).get(30)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        loss = float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)))
    assert loss == pytest.approx(pipelined["loss"], rel=1e-6, abs=0)
    _, plain = plain_training(data, 30, total=30)
    with torch.no_grad():
        assert torch.allclose(logits, plain(tokens[:, :-1]), rtol=0, atol=1e-3)
