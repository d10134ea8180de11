"""Numbers `tpc run` reads that would make a run silently wrong are refused before any work:
non-finite learning rates, weight decays, clipping norms, timeouts and tolerances (nan passes
every comparison, inf means nothing for these), and a discrete curriculum with a length after
its longest (DeepSpeed stays at the longest length once there, so that one would never run)."""

from __future__ import annotations

import pytest

from tpc.cli.main import main
from tpc.executors.curriculum import parse_curriculum
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import TpirError


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--grad-clip", "--timeout", "--tolerance"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_number_is_refused_naming_its_flag(flag, value, tmp_path, capsys):
    status = main(["run", "--interpret", str(tmp_path / "absent.tpir"), flag, value])
    err = capsys.readouterr().err
    assert status == 1
    assert flag in err and "finite" in err and value in err, err
    assert "Traceback" not in err


def test_the_library_refuses_them_too():
    with pytest.raises(TpirError, match="--grad-clip must be a finite number"):
        RunOptions(grad_clip=float("nan"))
    with pytest.raises(TpirError, match="finite number > 0, got inf"):
        OptimSpec(lr=float("inf"))
    assert RunOptions(grad_clip=1.0, timeout=5.0).grad_clip == 1.0  # finite numbers still pass


@pytest.mark.parametrize("spec", ["fixed_discrete:64,32:2", "fixed_discrete:32,128,64:2,4"])
def test_a_length_after_the_longest_is_refused(spec):
    with pytest.raises(TpirError, match="after the longest length"):
        parse_curriculum(spec)
    # going down before the longest is DeepSpeed's too, and runs (test_curriculum.py)
    assert parse_curriculum("fixed_discrete:64,32,128:5,10").difficulties == (64, 32, 128)


def test_an_empty_token_file_is_refused_not_a_traceback(tmp_path):
    from tpc.executors.training.eval_data import EvalBatches
    from tpc.executors.training.token_file import TokenFileBatches

    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(TpirError, match="0 tokens, fewer than one sequence of 17"):
        TokenFileBatches(str(empty), seed=0, batch=2, seq=16, vocab=256)
    with pytest.raises(TpirError, match="0 tokens, fewer than one sequence of 17"):
        EvalBatches(str(empty), batch=2, seq=16, vocab=256, count=1)


def test_a_latest_pointer_that_is_not_text_falls_back_to_the_newest_complete_step(tmp_path):
    from tpc.executors.training import checkpoint

    (tmp_path / checkpoint.LATEST).write_bytes(b"\xff\xfe step")
    assert checkpoint.latest_checkpoint(tmp_path) is None  # no step directory: nothing to resume


def _nan_run(allow: bool, tmp_path):
    import torch

    from tests.executors.fake import FakeLM, fake_factory, fake_plan
    from tpc.executors.interpreter import interpret
    from tpc.executors.training.run_checkpoints import RunCheckpoints

    plan = fake_plan(schedule="1f1b", stages=2, slices="3", microbatches=2)
    torch.manual_seed(0)
    model = FakeLM(n_layer=2)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    options = RunOptions(steps=2, optim=OptimSpec("sgd", 0.1), checkpoint_dir=str(tmp_path / "ck"),
                         save_every=1, allow_nonfinite_loss=allow)
    checkpoints = RunCheckpoints.from_options(plan, options, model=model)
    return interpret(plan, options, model=model, stage_factory_for=fake_factory, hidden_size=8,
                     checkpoints=checkpoints)


def test_a_nan_loss_stops_the_run_before_it_is_saved(tmp_path):
    """One training loop checks the loss of every step, for both executors: a nan loss never
    becomes a checkpoint (or `latest`) unless asked for."""
    with pytest.raises(TpirError, match=r"step 1: the loss is nan; the run stops before saving anything"):
        _nan_run(False, tmp_path)
    assert not list((tmp_path / "ck").glob("step_*"))
    result = _nan_run(True, tmp_path)  # asked for: it trains on, and saves
    assert len(result.losses) == 2 and all(loss != loss for loss in result.losses)
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_000001", "step_000002"]
