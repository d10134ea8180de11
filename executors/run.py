"""`tpc run`: verify the plan, then run it with the reference interpreter (`--interpret`) or, under
torchrun, with the distributed executor; optionally compare with plain autograd.

`--verify-grads` checks the first step, where both runs start from the same weights: the loss
and every parameter's gradient of the plan against plain single-process autograd on the
unsliced model with the same weights and batch. It prints the largest relative gradient error
(max |a - b| / max |b| per parameter) and the loss difference, and exits 1 above --tolerance.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import Diagnostic, TpirError


@dataclass(frozen=True)
class RunSettings:
    """The options of `tpc run` this executor acts on."""

    steps: int = 1
    seed: int = 0
    optim: OptimSpec = OptimSpec()
    device: str = "auto"
    bf16: bool = False
    timeout: float = 120.0
    trace: str | None = None
    data: str | None = None
    verify_grads: bool = False
    tolerance: float = 1e-5
    quiet: bool = False
    warmup: int = 0
    grad_clip: float = 0.0
    metrics: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: bool = False

    def lr_schedule(self):
        """step -> learning rate: linear warm-up over --warmup steps, then half a cosine down to
        a tenth of --lr at --steps (docs/training.md)."""
        from tpc.executors.training.lr import lr_at

        lr_at(0, peak=self.optim.lr, warmup=self.warmup, total=self.steps)  # refuses bad settings now
        return lambda step: lr_at(step, peak=self.optim.lr, warmup=self.warmup, total=self.steps)


def settings_from_args(args) -> RunSettings:
    """RunSettings from parsed `tpc run` arguments, refusing meaningless combinations before
    any work."""
    if args.steps < 1:
        raise TpirError(Diagnostic(f"--steps must be >= 1, got {args.steps}", where="--steps", hint="e.g. --steps 10"))
    if args.timeout <= 0:
        raise TpirError(Diagnostic(f"--timeout must be > 0, got {args.timeout}", where="--timeout",
                                   hint="seconds a rank waits for a peer, e.g. --timeout 120"))
    if args.grad_clip < 0:
        raise TpirError(Diagnostic(f"--grad-clip must be >= 0, got {args.grad_clip}", where="--grad-clip",
                                   hint="the largest global gradient norm, e.g. --grad-clip 1.0; 0 for none"))
    if args.tolerance <= 0:
        raise TpirError(Diagnostic(f"--tolerance must be > 0, got {args.tolerance}", where="--tolerance",
                                   hint="e.g. --tolerance 1e-5"))
    if args.save_every < 0:
        raise TpirError(Diagnostic(f"--save-every must be >= 0, got {args.save_every}", where="--save-every",
                                   hint="save every N steps, e.g. --save-every 100; 0 saves only at the end"))
    for flag, given in (("--save-every", args.save_every > 0), ("--resume", args.resume)):
        if given and not args.checkpoint_dir:
            raise TpirError(Diagnostic(f"{flag} needs --checkpoint-dir", where=flag,
                                       hint=f"e.g. --checkpoint-dir ckpt {flag}" + (" 100" if flag == "--save-every" else "")))
    if args.resume and args.verify_grads:
        raise TpirError(Diagnostic("--verify-grads checks the first step from the initial weights; "
                                   "a resumed run does not start there", where="--verify-grads",
                                   hint="check a fresh run (without --resume)"))
    return RunSettings(
        steps=args.steps, seed=args.seed,
        optim=OptimSpec(kind=args.optimizer, lr=args.lr, weight_decay=args.weight_decay),
        device=args.device, bf16=args.bf16, timeout=args.timeout, trace=args.trace, data=args.data,
        verify_grads=args.verify_grads, tolerance=args.tolerance, quiet=args.quiet,
        warmup=args.warmup, grad_clip=args.grad_clip, metrics=args.metrics,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, resume=args.resume)


def run_from_cli(args) -> int:
    """`tpc run`: the exit status (0 ok; 1 on a refused plan or failed gradient check)."""
    from tpc.ir.verify import verify_file

    settings = settings_from_args(args)
    if args.interpret:
        plan = verify_file(args.plan)
        return interpret_plan(plan, settings)
    if "WORLD_SIZE" in os.environ:
        from tpc.executors.distributed import main

        return main(args.plan, settings)
    raise TpirError(Diagnostic(
        "`tpc run` needs torchrun (one process per rank) or --interpret (all ranks in this process)",
        where=args.plan,
        hint=f"torchrun --nproc-per-node N --no-python tpc run {args.plan}   (N = pipe x data of the plan's mesh)\n"
             f"or: tpc run --interpret {args.plan}"))


def batch_source(plan, settings: RunSettings):
    """Token-file batches with --data, else random tokens seeded by --seed."""
    shape = plan.header.shape
    if settings.data:
        from tpc.executors.training.token_file import TokenFileBatches

        return TokenFileBatches(settings.data, seed=settings.seed, batch=shape.batch, seq=shape.seq,
                                vocab=shape.vocab)
    from tpc.executors.training.batches import RandomTokens

    return RandomTokens(settings.seed, shape.batch, shape.seq, shape.vocab)


def check_bf16(settings: RunSettings, device: torch.device) -> None:
    if settings.bf16 and device.type != "cuda":
        raise TpirError(Diagnostic("--bf16 needs CUDA", where="--bf16",
                                   hint="drop --bf16 on CPU (training runs in fp32 there)"))


def interpret_plan(plan, settings: RunSettings) -> int:
    """Run a verified plan with the reference interpreter; print losses; check; trace."""
    from tpc.executors.distributed import check_model_file
    from tpc.executors.interpreter import interpret, load_plan_model
    from tpc.executors.training.run_checkpoints import RunCheckpoints

    check_model_file(plan)
    device = torch.device("cuda" if settings.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if settings.device == "cuda" and device.type != "cuda":
        raise TpirError(Diagnostic("--device cuda, but CUDA is not available", where="--device",
                                   hint="use --device cpu"))
    check_bf16(settings, device)
    model = load_plan_model(plan, settings.seed)
    reference = copy.deepcopy(model) if settings.verify_grads else None
    batches = batch_source(plan, settings)
    reporter = Reporter(settings, plan, rank=0)
    checkpoints = RunCheckpoints.from_settings(plan, settings, say=reporter.message)
    result = interpret(plan, steps=settings.steps, model=model, batches=batches, optim=settings.optim,
                       device=device, trace=bool(settings.trace), verify=False,
                       lr_at=settings.lr_schedule(), grad_clip=settings.grad_clip,
                       grad_norm=bool(settings.metrics), on_step=reporter, checkpoints=checkpoints,
                       bf16=settings.bf16)
    reporter.close()
    if settings.trace:
        write_trace(settings.trace, result.events)
    if not settings.verify_grads:
        return 0
    loss, grads = result.losses[0], result.first_grads
    ref_loss, ref_grads = reference_gradients(reference, batches.get(0))
    worst, name = compare_grads(grads, ref_grads)
    return report_check(loss, ref_loss, worst, name, settings.tolerance)


class Reporter:
    """After each step: the progress line on rank 0 (unless --quiet) and, with --metrics, one
    JSON line (docs/training.md). Steps are counted from 1 in both. Loss and tokens are the
    global batch's (the executors pass the loss summed over all ranks). The metrics file is
    opened at the first step this run makes: a fresh run starts it afresh; a resumed run keeps
    the rows up to the step it resumed at (a crashed run may have logged past its last
    checkpoint) and appends, so the file reads as one run."""

    def __init__(self, settings: RunSettings, plan, rank: int):
        from tpc.executors.training.progress import Progress

        self.settings = settings
        self.tokens = plan.header.tokens_per_step
        self.progress = Progress(settings.steps, quiet=settings.quiet, rank=rank)
        self.write_metrics = bool(settings.metrics) and rank == 0
        self.metrics = None

    def __call__(self, step: int, loss: float, info: dict) -> None:
        t = info["step_time"]
        self.progress.update(step + 1, loss=loss, tokens=self.tokens, step_time=t, lr=info["lr"],
                             grad_norm=info["grad_norm"])
        if self.write_metrics:
            if self.metrics is None:
                self.metrics = self._open(first_step=step)
            self.metrics.write(step + 1, loss=loss, lr=info["lr"], grad_norm=info["grad_norm"],
                               tokens_per_s=self.tokens / t if t > 0 else float("inf"), step_time=t)

    def _open(self, first_step: int):
        from tpc.executors.training.progress import MetricsWriter

        if self.settings.resume:
            return MetricsWriter(self.settings.metrics, append=True, keep_through=first_step)
        return MetricsWriter(self.settings.metrics)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()


def reference_gradients(model: torch.nn.Module, tokens: torch.Tensor):
    """Loss and gradients (by parameter name) of plain autograd on the unsliced model."""
    from tpc.executors.oracle import reference_step

    ids, targets = tokens[:, :-1], tokens[:, 1:]
    loss, grads = reference_step(model, ids, targets)
    return float(loss), {n: g.detach().cpu() for n, g in dict(grads).items()}


def compare_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative error over parameters, max |a - b| / max |b| of each, and the name
    of the worst; a parameter missing on either side is an infinite error."""
    worst, worst_name = 0.0, ""
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            return float("inf"), name
        a, b = got[name].detach().double().cpu(), want[name].detach().double().cpu()
        scale = float(b.abs().max()) if b.numel() else 0.0
        diff = float((a - b).abs().max()) if b.numel() else 0.0
        err = diff / scale if scale > 0 else diff
        if err > worst or not worst_name:
            worst, worst_name = err, name
    return worst, worst_name


def report_check(loss: float, ref_loss: float, worst: float, name: str, tolerance: float,
                 show: bool = True) -> int:
    """The comparison with plain autograd: 1 when an error exceeds the tolerance; printed unless
    `show` is false (the other ranks of a distributed run)."""
    loss_diff = abs(loss - ref_loss)
    loss_rel = loss_diff / abs(ref_loss) if ref_loss else loss_diff
    ok = worst <= tolerance and loss_rel <= tolerance
    if show:
        print(f"verify-grads: loss {loss:.8f} vs autograd {ref_loss:.8f} (difference {loss_diff:.3e}); "
              f"largest relative gradient error {worst:.3e} ({name}); tolerance {tolerance:g}: "
              f"{'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def write_trace(path: str, events) -> None:
    from tpc.executors.engine import chrome_trace

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(events)), encoding="utf-8")
    print(f"trace: {path} ({len(events)} instructions)", file=sys.stderr)
