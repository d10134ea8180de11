"""`RunOptions`: the one description of a training run, for both executors.

`tpc run`'s flags are read into it (tpc.cli.run); the reference interpreter
(`executors.interpreter.interpret`), the distributed executor (`executors.distributed`) and every
rank's engine (`executors.engine.RankEngine`) read the fields they act on. Checked on
construction: a meaningless setting is a TpirError naming its flag, before any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.semantics import GLOO, NCCL, CommRules

LR_SCHEDULES = ("cosine", "constant")


def _refuse(flag: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, where=flag, hint=hint))


@dataclass(frozen=True)
class RunOptions:
    steps: int = 1
    seed: int = 0  # weights (the model built after torch.manual_seed(seed)) and random batches
    optim: OptimSpec = field(default_factory=OptimSpec)
    # the learning rate of step s: "cosine" warms up linearly over `warmup` steps, then follows
    # half a cosine down to a tenth of the peak at `steps` (training/lr.py); "constant" keeps
    # the optimizer's own
    lr_schedule: str = "cosine"
    warmup: int = 0
    grad_clip: float = 0.0  # clip the global gradient norm to this before each update (0: never)
    device: str = "auto"  # cpu | cuda | auto (cuda when present)
    bf16: bool = False  # bf16 autocast around compute (CUDA only; weights, grads, messages fp32)
    timeout: float = 120.0  # seconds a rank waits for a peer before giving up (torchrun)
    data: str | None = None  # token file; None: random tokens from `seed`
    # the separator id of packed documents (`--documents eos:ID`); the plan must say the same
    documents: int | None = None
    # record each instruction's start and end; with `trace_path`, write them there (Chrome
    # trace). On CUDA the engine waits for the device after each instruction, so a traced run
    # is slower.
    trace: bool = False
    trace_path: str | None = None
    metrics: str | None = None  # one JSON line per step
    checkpoint_dir: str | None = None
    save_every: int = 0  # save a checkpoint every N steps (and at the end); 0: only at the end
    resume: bool = False  # continue from the newest checkpoint in `checkpoint_dir`
    # start from these weights (a state_dict .pt, a .safetensors file, a Hugging Face model
    # directory or a tpc checkpoint; training/weight_files.py); with `resume`, only when
    # `checkpoint_dir` holds no checkpoint yet
    init_from: str | None = None
    # compare the first step's loss and gradients with plain autograd; fail above `tolerance`
    verify_grads: bool = False
    tolerance: float = 1e-5
    quiet: bool = False  # no progress line
    # keep a copy of every gradient at `step` (before the update), for checks
    record_grads: bool = False
    # compute the global gradient norm every step even without clipping or metrics
    grad_norm: bool = False
    # the communication rules the run follows and its plan is verified under
    # (tpc.ir.semantics.COMMS): None is the backend's own ("nccl" on CUDA, "gloo" on the CPU
    # and in the interpreter); "nccl" on the CPU runs NCCL's rules there (the interpreter and
    # gloo: a send completes only when its receive is posted), so CPU tests exercise them
    comm: CommRules | None = None  # a spelling ("gloo") is read as CommRules
    # a step whose loss is nan or inf stops the run before anything of it is saved, unless this
    # says to train on regardless
    allow_nonfinite_loss: bool = False
    # validation (executors/evaluation.py): the plan's evaluation program on `eval_batches`
    # batches of this token file, before the first step, every `eval_every` steps (0: only
    # then) and after the last; `save_best` keeps the checkpoint of the lowest validation loss
    # run every stage through its programs (tpc.compiler.programs) compiled with torch.compile;
    # without it a stage runs eagerly, under autograd, unless its plan splits its backward
    # (then through its traced programs, uncompiled)
    compile: bool = False
    # on a mesh with a tensor axis, run two computes of consecutive slices that a rank's stream
    # puts side by side (what `tpc compile --tensor-overlap` arranges) as one program whose
    # collectives overlap the other slice's compute (compiler/tensor/overlap.py); False runs
    # each alone (`tpc run --no-slice-pairs`: to measure what the pairs hide, or to rule them out)
    slice_pairs: bool = True
    # shard the optimizer state (and the update) over each stage's data-parallel group
    # (ZeRO-1, training/sharded_optimizer.py); nothing to shard without data-parallel replicas
    shard_optimizer: bool = False
    # the library's pipelines (tpc.Pipeline): a plan's `step` updates nothing; it leaves the
    # gradients, summed over the ranks that share each parameter, for the user's own optimizer
    external_optimizer: bool = False
    eval_data: str | None = None
    eval_every: int = 0
    eval_batches: int = 4
    save_best: bool = False
    # random layerwise token dropping (tpc.compiler.random_ltd.RandomLTD): its units run on a
    # random subset of each slice's tokens, the kept count following its schedule; None: off
    random_ltd: object = None

    def __post_init__(self):
        # (the optimizer's numbers are checked by OptimSpec)
        for flag, value, example in (("--grad-clip", self.grad_clip, "--grad-clip 1.0, or 0 for none"),
                                     ("--timeout", self.timeout, "--timeout 120"),
                                     ("--tolerance", self.tolerance, "--tolerance 1e-5")):
            # nan passes the comparisons below and inf means nothing here: --grad-clip nan would
            # turn clipping off, --grad-clip inf scale gradients by inf, --tolerance inf pass any
            # gradient check, --timeout inf fail as a rendezvous error
            if not math.isfinite(value):
                raise _refuse(flag, f"{flag} must be a finite number, got {value}", f"e.g. {example}")
        if self.steps < 1:
            raise _refuse("--steps", f"--steps must be >= 1, got {self.steps}", "e.g. --steps 10")
        if self.timeout <= 0:
            raise _refuse("--timeout", f"--timeout must be > 0, got {self.timeout}",
                          "seconds a rank waits for a peer, e.g. --timeout 120")
        if self.grad_clip < 0:
            raise _refuse("--grad-clip", f"--grad-clip must be >= 0, got {self.grad_clip}",
                          "the largest global gradient norm, e.g. --grad-clip 1.0; 0 for none")
        if self.tolerance <= 0:
            raise _refuse("--tolerance", f"--tolerance must be > 0, got {self.tolerance}",
                          "e.g. --tolerance 1e-5")
        if self.save_every < 0:
            raise _refuse("--save-every", f"--save-every must be >= 0, got {self.save_every}",
                          "save every N steps, e.g. --save-every 100; 0 saves only at the end")
        for flag, given in (("--save-every", self.save_every > 0), ("--resume", self.resume)):
            if given and not self.checkpoint_dir:
                raise _refuse(flag, f"{flag} needs --checkpoint-dir",
                              f"e.g. --checkpoint-dir ckpt {flag}" + (" 100" if flag == "--save-every" else ""))
        if self.resume and self.verify_grads:
            raise _refuse("--verify-grads", "--verify-grads checks the first step from the initial "
                          "weights; a resumed run does not start there", "check a fresh run (without --resume)")
        if self.init_from is not None and not Path(self.init_from).exists():
            raise _refuse("--init-from", f"--init-from {self.init_from}: no such file or directory",
                          "give a state_dict .pt, a .safetensors file, a Hugging Face model directory "
                          "(config.json + safetensors) or a checkpoint directory")
        if self.random_ltd is not None and self.compile:
            raise _refuse("--random-ltd", "random-LTD runs the stages under eager autograd; --compile "
                          "runs their compiled programs", "drop --compile, or --random-ltd")
        if self.lr_schedule not in LR_SCHEDULES:
            raise _refuse("--lr-schedule", f"unknown learning-rate schedule {self.lr_schedule!r}",
                          f"use one of: {', '.join(LR_SCHEDULES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise _refuse("--device", f"unknown device {self.device!r}", "use cpu, cuda or auto")
        if self.comm is not None:
            try:
                object.__setattr__(self, "comm", CommRules.of(self.comm))  # typed from here on
            except ValueError as e:
                raise _refuse("--comm", str(e), "use " + " or ".join(c.value for c in CommRules)) from None
        if self.eval_every < 0:
            raise _refuse("--eval-every", f"--eval-every must be >= 0, got {self.eval_every}",
                          "evaluate every N steps, e.g. --eval-every 100; 0 evaluates only before the "
                          "first and after the last step")
        if self.eval_batches < 1:
            raise _refuse("--eval-batches", f"--eval-batches must be >= 1, got {self.eval_batches}",
                          "the number of validation batches, e.g. --eval-batches 4")
        for flag, given in (("--eval-every", self.eval_every > 0), ("--save-best", self.save_best)):
            if given and not self.eval_data:
                raise _refuse(flag, f"{flag} needs --eval-data",
                              "give the validation token file, e.g. --eval-data data/val.bin")
        if self.save_best and not self.checkpoint_dir:
            raise _refuse("--save-best", "--save-best needs --checkpoint-dir",
                          "e.g. --checkpoint-dir ckpt --save-best (the best checkpoint is DIR/best)")
        if self.external_optimizer and (self.shard_optimizer or self.grad_clip > 0):
            raise _refuse("--shard-optimizer" if self.shard_optimizer else "--grad-clip",
                          "a pipeline whose optimizer is the user's cannot shard tpc's optimizer state "
                          "or clip inside the step", "clip with Pipeline.clip_grad_norm_ before your "
                          "optimizer's step; shard its state with your own tools")
        self.lr_at(0)  # refuses a meaningless schedule (warm-up past the end) now

    def check_outputs(self) -> None:
        """Refuse, before any work, an output that could not be written when the run gets to it:
        --trace (written at the end), --metrics (at the first step), --checkpoint-dir (at the
        first save; and not in use by another run). Each is a located TpirError naming the
        path and what to do (tpc.ir.files.check_output)."""
        from tpc.ir.files import check_output

        if self.trace_path:
            check_output(self.trace_path, option="--trace", parents=True)
        if self.metrics:
            check_output(self.metrics, option="--metrics", parents=True)
        if self.checkpoint_dir:
            from tpc.executors.training.dir_lock import DirLock

            check_output(self.checkpoint_dir, option="--checkpoint-dir", folder=True, parents=True)
            DirLock(self.checkpoint_dir).check_free()

    @property
    def traced(self) -> bool:
        """Each instruction's start and end are recorded (asked for, or to write a trace file)."""
        return self.trace or self.trace_path is not None

    @property
    def keeps_grads(self) -> bool:
        """Each step's gradients are kept (before the update): asked for, or to check them."""
        return self.record_grads or self.verify_grads

    @property
    def needs_grad_norm(self) -> bool:
        """The global gradient norm is computed each step: to clip, to log, or when asked."""
        return self.grad_clip > 0 or self.metrics is not None or self.grad_norm

    def comm_rules(self, device: torch.device, interpreted: bool = False) -> CommRules:
        """The communication rules of this run: `comm` when given, else the backend's own
        (NCCL on CUDA under torchrun; buffered sends on gloo and in the interpreter)."""
        if self.comm is not None:
            rules = CommRules.of(self.comm)
            if rules is GLOO and device.type == "cuda" and not interpreted:
                raise _refuse("--comm", "--comm gloo on CUDA: torchrun ranks on GPUs talk over NCCL",
                              "leave out --comm (NCCL's rules), or run on the CPU")
            return rules
        return NCCL if device.type == "cuda" and not interpreted else GLOO

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counting from 0)."""
        if self.lr_schedule == "constant":
            return self.optim.lr
        from tpc.executors.training.lr import lr_at

        return lr_at(step, peak=self.optim.lr, warmup=self.warmup, total=self.steps)

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device this run computes on: cpu, or cuda:`local_rank` (auto: CUDA when present)."""
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda":
            if not torch.cuda.is_available():
                raise _refuse("--device", "--device cuda, but CUDA is not available",
                              "use --device cpu (gloo), or run on a machine with GPUs")
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise _refuse("--device", f"this is process {local_rank} of its node, which has {count} GPU(s)",
                              f"start at most {count} processes per node (torchrun --nproc-per-node "
                              f"{count}, and --nnodes for more), one per GPU")
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
