"""Process targets for the distributed tests on the fake LM (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tests.executors.fake import FakeLM, fake_factory, fake_plan
from tpc.executors.training.batches import RandomTokens
from tpc.executors.distributed import World, fail, init, run_plan
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec


def _run(case: dict, world: World, timeout: float, hook=None):
    plan = fake_plan(**case["plan"])
    torch.manual_seed(0)
    model = FakeLM(n_layer=case["plan"].get("n_layer", 2), tie=case["plan"].get("tie", False))
    h = plan.header.shape
    spec = OptimSpec(*case.get("optim", ("sgd", 0.1)))
    options = RunOptions(steps=case.get("steps", 1), optim=spec, record_grads=True,
                         grad_clip=case.get("clip", 0.0), timeout=timeout,
                         lr_schedule="cosine" if "warmup" in case else "constant",
                         warmup=case.get("warmup", 0), comm=case.get("comm"))
    return run_plan(plan, world, options, model=model, device=torch.device("cpu"),
                    stage_factory=fake_factory(model), hidden_size=8,
                    batches=RandomTokens(0, h.batch, h.seq, h.vocab), before_instr=hook)


def run_cases(rank: int, out_dir: str, cases: list[dict], timeout: float) -> None:
    """Run each case in turn in one process group; save each rank's outcome."""
    world = World.from_env()
    init(world, torch.device("cpu"), timeout)
    for i, case in enumerate(cases):
        try:
            outcome = _run(case, world, timeout)
        except Exception as e:  # noqa: BLE001 - report like the executor does
            fail(str(e))
        torch.save({"losses": outcome.losses, "first_grads": outcome.first_grads, "params": outcome.params},
                   Path(out_dir) / f"case{i}_rank{rank}.pt")


def run_with_fault(rank: int, out_dir: str, case: dict, victim: int, index: int, kind: str,
                   timeout: float) -> None:
    """Rank `victim` dies (kind "kill": SIGKILL) or fails (kind "raise") at instruction `index`."""
    world = World.from_env()
    init(world, torch.device("cpu"), timeout)

    def hook(engine, at):
        if rank == victim and at == index:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")

    try:
        _run(case, world, timeout, hook)
    except Exception as e:  # noqa: BLE001
        fail(e if hasattr(e, "render") else str(e))
    os._exit(0)


def run_real_cases(rank: int, out_dir: str, cases: list[dict], timeout: float) -> None:
    """Like `run_cases`, on the tiny example GPT (traced once in this process), or the tiny
    example model a case names (`case["model"]`, e.g. "llama")."""
    from tests.executors.real import fresh_model, real_plan

    world = World.from_env()
    init(world, torch.device("cpu"), timeout)
    for i, case in enumerate(cases):
        try:
            name = case.get("model", "gpt")
            plan = real_plan(name, **case["plan"])
            model, sliced = fresh_model(name, plan.header.shape.seq)
            h = plan.header.shape
            options = RunOptions(steps=case.get("steps", 1), optim=OptimSpec(*case.get("optim", ("sgd", 0.1))),
                                 lr_schedule="constant",
                                 record_grads=True, timeout=timeout, comm=case.get("comm"))
            outcome = run_plan(plan, world, options, model=model, device=torch.device("cpu"), sliced=sliced,
                               batches=RandomTokens(0, h.batch, h.seq, h.vocab))
        except Exception as e:  # noqa: BLE001
            fail(e if hasattr(e, "render") else f"{type(e).__name__}: {e}")
        torch.save({"losses": outcome.losses, "first_grads": outcome.first_grads, "params": outcome.params},
                   Path(out_dir) / f"case{i}_rank{rank}.pt")


def run_buffered_only(rank: int, out_dir: str, case: dict, timeout: float) -> None:
    """Run, under NCCL's rules on gloo (`comm="nccl"`), the plan lowered for gloo's buffered
    sends (no exchanges): a plan that deadlocks on NCCL, run without the verifier."""
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule
    from tests.executors.fake import fake_header

    world = World.from_env()
    init(world, torch.device("cpu"), timeout)
    header = fake_header(**case["plan"])
    plan = lower(header, build_schedule(header.schedule.name, header), comm="gloo")
    torch.manual_seed(0)
    model = FakeLM(n_layer=2, tie=case["plan"].get("tie", False))
    options = RunOptions(timeout=timeout, comm="nccl")
    try:
        run_plan(plan, world, options, model=model, device=torch.device("cpu"),
                 stage_factory=fake_factory(model), hidden_size=8,
                 batches=RandomTokens(0, header.shape.batch, header.shape.seq, header.shape.vocab))
    except Exception as e:  # noqa: BLE001
        fail(e if hasattr(e, "render") else str(e))
    os._exit(0)
