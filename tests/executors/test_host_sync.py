"""A training step waits for the device once: to read its loss and gradient norm together.

DESIGN.md section 9. Whole training steps run on the CPU under `HostSyncMonitor`, a
TorchDispatchMode that records every host-syncing call (`.item()`, `float(t)`, `if t:`,
`torch.equal`, `nonzero`, boolean-mask indexing, `.tolist()`, `.cpu()`, ...) made inside a step
or an evaluation outside the one read (`tpc.executors.host_sync.read`), with the Python line that
made it. Every schedule family runs here (1F1B, a split-backward zero-bubble schedule,
interleaved and V-shaped chunks, data parallelism), with several slices, gradient clipping, the
non-finite-loss stop and evaluation on; a gloo run of two ranks does the same (slow tier). The
monitor's own tests show that it fails a step that reads the device (an `.item()` injected into
a forward) and that the allowed read does not count.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.executors.real import fresh_model, real_plan
from tpc.compiler.lowering.eval_program import eval_program
from tpc.executors import host_sync
from tpc.executors.engine import STEP_READ, RankEngine
from tpc.executors.host_sync import HostSyncMonitor
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import TpirError

SEQ = 16
STEPS = 2
# clipping with a limit below the norm (the factor is applied), AdamW (its step count is read on
# the host), the non-finite-loss stop on (RunOptions' default)
TRAIN = dict(steps=STEPS, grad_clip=0.05, optim=OptimSpec("adamw", 1e-2))

CASES = {
    "1f1b": dict(schedule="1f1b", stages=2, slices="2,9,5", microbatches=2),
    "zb-h1": dict(schedule="zb-h1", stages=2, slices="3", microbatches=2),
    "interleaved": dict(schedule="interleaved", stages=4, ranks=2, slices="3", microbatches=2),
    "zbv": dict(schedule="zbv", stages=4, ranks=2, slices="2,9,5", microbatches=2),
    "dp2": dict(schedule="seq1f1b", stages=2, slices="3", microbatches=2, dp=2, batch=8),
}
# the same plans with every stage's programs compiled (--compile): the compiled code reads
# nothing of the device either
COMPILED = {"zb-h1": CASES["zb-h1"]}


def watched_run(plan, options: RunOptions, **kw):
    """`interpret` under the monitor, recording only inside the loop's steps and evaluations."""
    model, sliced = fresh_model("gpt", SEQ)
    with HostSyncMonitor(watched_only=True) as monitor:
        result = interpret(plan, options, model=model, sliced=sliced, **kw)
    return result, monitor


def step_reads(steps: int) -> list:
    return [(f"step {s + 1}", STEP_READ) for s in range(steps)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_reads_the_device_once(case):
    plan = real_plan("gpt", seq_len=SEQ, **CASES[case])
    norms = []
    result, monitor = watched_run(plan, RunOptions(**TRAIN),
                                  on_step=lambda step, loss, info: norms.append(info["grad_norm"]))
    assert not monitor.syncs, monitor.report()
    assert monitor.reads == step_reads(STEPS)
    assert len(result.losses) == STEPS and all(n > 0.05 for n in norms)  # read, and clipped


@pytest.mark.parametrize("case", sorted(COMPILED))
def test_a_compiled_step_reads_the_device_once(case):
    plan = real_plan("gpt", seq_len=SEQ, **COMPILED[case])
    result, monitor = watched_run(plan, RunOptions(**TRAIN, compile=True, quiet=True))
    assert not monitor.syncs, monitor.report()
    assert monitor.reads == step_reads(STEPS)
    assert len(result.losses) == STEPS


def test_an_evaluation_reads_the_device_once(tmp_path):
    """Evaluation before the first step and after each: its batches' losses in one read."""
    from tpc.executors.training.eval_data import EvalBatches

    plan = real_plan("gpt", seq_len=SEQ, **CASES["1f1b"])
    plan = dataclasses.replace(plan, eval=eval_program(plan.header))
    val = tmp_path / "val.bin"
    np.random.default_rng(1).integers(0, 256, 2000).astype(np.uint16).tofile(val)
    batches = EvalBatches(str(val), batch=4, seq=SEQ, vocab=256, count=2)
    options = RunOptions(**TRAIN, eval_every=1, eval_data=str(val))
    result, monitor = watched_run(plan, options, eval_batches=batches)
    assert not monitor.syncs, monitor.report()
    assert [d for d, _ in result.eval_losses] == [0, 1, 2]
    assert monitor.reads == [("the evaluation", "the validation loss"),
                             ("step 1", STEP_READ), ("step 1", "the validation loss"),
                             ("step 2", STEP_READ), ("step 2", "the validation loss")]


def test_a_nan_loss_stops_the_run_on_the_steps_one_read():
    plan = real_plan("gpt", seq_len=SEQ, **CASES["zb-h1"])
    model, sliced = fresh_model("gpt", SEQ)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with HostSyncMonitor(watched_only=True) as monitor:
        with pytest.raises(TpirError, match="step 1: the loss is nan"):
            interpret(plan, RunOptions(**TRAIN), model=model, sliced=sliced)
    assert not monitor.syncs, monitor.report()
    assert monitor.reads == step_reads(1)


# ----------------------------------------------------------------------------- the monitor


def test_a_read_injected_into_a_step_fails_it_and_names_its_line(monkeypatch):
    forward = RankEngine._forward

    def reads_each_loss(self, instr):
        forward(self, instr)
        if instr.stage == self.last_stage:
            self.step_loss.item()  # the injected sync

    monkeypatch.setattr(RankEngine, "_forward", reads_each_loss)
    plan = real_plan("gpt", seq_len=SEQ, **CASES["1f1b"])
    _, monitor = watched_run(plan, RunOptions(**TRAIN))
    forwards = sum(1 for i in plan.ranks[1].instrs if i.op.value == "forward")
    assert len(monitor.syncs) == STEPS * forwards
    report = monitor.report()
    assert "aten._local_scalar_dense" in report and "self.step_loss.item()  # the injected sync" in report
    assert __file__ in report and "in step 1" in report
    assert all(s.region in ("step 1", "step 2") for s in monitor.syncs)


def test_each_kind_of_sync_is_seen_and_the_allowed_read_is_not():
    t = torch.randn(8)
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = torch.optim.AdamW([p], foreach=True)
    total = float(t.sum())
    with HostSyncMonitor() as monitor:
        t.sum().item()
        float(t.max())
        bool(t[0] > 0)  # what `if t[0] > 0:` calls
        torch.equal(t, t)
        t.nonzero()
        t[t > 0]
        t.tolist()
        t.cpu()
        # not syncs: the allowed read, what `allowed` marks, and torch.optim reading its step
        # count (a CPU tensor on every device)
        assert host_sync.read([t.sum(), 2.0, None], "the loss") == [pytest.approx(total), 2.0, None]
        with host_sync.allowed("a deliberate read"):
            t.sum().item()
        opt.step()
    ops = [s.op for s in monitor.syncs]
    assert ops == ["aten._local_scalar_dense.default"] * 3 + [
        "aten.equal.default", "aten.nonzero.default", "aten.index.Tensor with a boolean mask",
        "Tensor.tolist()", "Tensor.cpu()"], monitor.report()
    assert all(s.where.startswith(f"{__file__}:") for s in monitor.syncs)
    assert monitor.reads == [(None, "the loss")]
    assert "cpu" not in torch.Tensor.__dict__ and "tolist" not in torch.Tensor.__dict__  # put back


def test_a_watched_only_monitor_records_inside_steps_only():
    t = torch.randn(4)
    with HostSyncMonitor(watched_only=True) as monitor:
        t.sum().item()  # setting up, between steps: not the step's
        with host_sync.watched("step 7"):
            t.sum().item()
    assert [s.region for s in monitor.syncs] == ["step 7"]


# ----------------------------------------------------------------------------- torchrun (gloo)


def _rank(rank: int, out_dir: str, timeout: float) -> None:
    from pathlib import Path

    from tpc.executors.distributed import World, fail, init, run_plan
    from tpc.executors.training.batches import RandomTokens

    world = World.from_env()
    init(world, torch.device("cpu"), timeout)
    try:
        plan = real_plan("gpt", seq_len=SEQ, **CASES["1f1b"])
        model, sliced = fresh_model("gpt", SEQ)
        h = plan.header.shape
        with HostSyncMonitor(watched_only=True) as monitor:
            outcome = run_plan(plan, world, RunOptions(**TRAIN, timeout=timeout), model=model,
                               device=torch.device("cpu"), sliced=sliced,
                               batches=RandomTokens(0, h.batch, h.seq, h.vocab))
    except Exception as e:  # noqa: BLE001
        fail(e if hasattr(e, "render") else f"{type(e).__name__}: {e}")
    torch.save({"losses": outcome.losses, "syncs": [str(s) for s in monitor.syncs],
                "report": monitor.report(), "reads": monitor.reads}, Path(out_dir) / f"rank{rank}.pt")


def test_two_gloo_ranks_read_the_device_once_a_step(tmp_path):
    from tests.executors.dist_harness import launch

    codes, errs = launch(2, tmp_path, _rank, 30.0, limit=180)
    assert codes == [0, 0], errs
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for g in got:
        assert not g["syncs"], g["report"]
        assert g["reads"] == step_reads(STEPS)
    assert got[0]["losses"] == got[1]["losses"]


def test_a_sharded_optimizer_step_reads_the_device_once():
    """`--shard-optimizer`: reduce-scatter, the norm over the chunks (summed over the pipeline and
    the data-parallel group on the device), the update and the all-gather add no read."""
    plan = real_plan("gpt", seq_len=SEQ, **CASES["dp2"])
    result, monitor = watched_run(plan, RunOptions(**TRAIN, shard_optimizer=True))
    assert not monitor.syncs, monitor.report()
    assert monitor.reads == step_reads(STEPS)
    assert len(result.losses) == STEPS
