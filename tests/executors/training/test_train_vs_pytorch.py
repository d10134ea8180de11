"""`tpc run` trains exactly as plain PyTorch does: 50 steps through the interpreter give the losses
of ordinary single-process training of the unsliced model (same weights, same batches from the
token file, AdamW with decay groups, warm-up + cosine, global gradient-norm clipping) within 1e-4
at every step. Two real gloo processes are held to the same standard in test_resume.py (a
10-step run stopped and resumed, so one pair of launches covers both)."""

from __future__ import annotations

import pytest

from tests.executors.training.run_helpers import CLIP, TRAIN, metrics, plain_training, schedule, write_plan, write_tokens
from tpc.cli.main import main

TOL = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    return write_plan(d), write_tokens(d)


def check_against_plain(rows, plain, total):
    assert [r["step"] for r in rows] == list(range(1, len(plain) + 1))
    for r, want in zip(rows, plain):
        assert abs(r["loss"] - want) <= TOL, (r["step"], r["loss"], want)
        assert r["lr"] == pytest.approx(schedule(r["step"] - 1, total), rel=1e-12)


def test_interpreter_50_steps_match_plain_pytorch(files, tmp_path, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plan, data = files
    out = tmp_path / "m.jsonl"
    assert main(["run", "--interpret", plan, "--steps", "50", "--data", data, *TRAIN, "--metrics", str(out), "-q"]) == 0
    rows = metrics(out)
    plain, _ = plain_training(data, 50, total=50)
    check_against_plain(rows, plain, total=50)
    assert any(r["grad_norm"] > CLIP for r in rows)  # the clipping path ran
    assert sum(plain[-5:]) / 5 < plain[0] - 0.5  # and the model learned something
