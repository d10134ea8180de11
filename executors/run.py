"""Running a plan as `tpc run` does: around either executor, the batches, the progress line and
metrics, the trace file and the check against plain autograd.

`RunSetup` is what both executors read and check before any work (one plan or a bundle under a
curriculum); `interpret_main` runs it with the reference interpreter (every rank in this
process); `tpc.executors.distributed.main` runs one rank under torchrun from the same setup.

`--verify-grads` (`GradientCheck`) checks the first step, where both runs start from the same
weights: the loss and every parameter's gradient of the plan against plain single-process
autograd on the unsliced model with the same weights and batch, by the one gradient-error
measure (`tpc.executors.oracle.gradient_error`), exiting 1 above `options.tolerance`. The
reference model is built by calling the model's factory again after the same seed and loading
the plan model's initial state (a copy.deepcopy of a model that captures modules in closures
would compute with the original's modules).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tpc.executors.evaluation import eval_batches, perplexity
from tpc.executors.options import RunOptions
from tpc.executors.oracle import batch_reference, gradient_error, gradient_floor
from tpc.executors.plan_model import check_plan_model, load_plan_model
from tpc.executors.pipeline import PlanSet
from tpc.executors.tensor_ranks import check_tensor_run
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.semantics import DEFAULT_COMM, CommRules


def batch_source(plan: Plan, options: RunOptions):
    """Token-file batches with `options.data`, else random tokens seeded by `options.seed`."""
    shape = plan.header.shape
    if options.data:
        from tpc.executors.training.token_file import TokenFileBatches

        docs = plan.header.documents
        return TokenFileBatches(options.data, seed=options.seed, batch=shape.batch, seq=shape.seq,
                                vocab=shape.vocab, eos=docs.eos if docs is not None else None)
    from tpc.executors.training.batches import RandomTokens

    return RandomTokens(options.seed, shape.batch, shape.seq, shape.vocab)


def check_documents_run(plan: Plan, options: RunOptions) -> None:
    """`--documents eos:ID` and the plan agree: a plan compiled for packed documents resets
    positions and masks attention at the separator it names, one compiled without attends across
    the whole row; each is refused with the other data, saying why."""
    docs, eos = plan.header.documents, options.documents
    if docs is None and eos is not None:
        raise TpirError(Diagnostic(
            f"--documents eos:{eos}: the plan was compiled for rows of one text each, so its attention "
            "would run across document boundaries and its positions would not restart",
            loc=plan.header.shape.loc, where=plan.source,
            hint=f"compile the plan with --documents eos:{eos}, or run without --documents"))
    if docs is not None and eos is None:
        raise TpirError(Diagnostic(
            f"the plan was compiled for packed documents ended by token {docs.eos}, and the run has no "
            "--documents: every row would be cut into documents at that token without being asked",
            loc=docs.loc, where=plan.source,
            hint=f"run with --documents eos:{docs.eos}, or compile the plan without --documents"))
    if docs is not None and eos != docs.eos:
        raise TpirError(Diagnostic(
            f"--documents eos:{eos}, and the plan was compiled for documents ended by token {docs.eos}",
            loc=docs.loc, where=plan.source,
            hint=f"run with --documents eos:{docs.eos}, or compile the plan with --documents eos:{eos}"))


def check_bf16(options: RunOptions, device: torch.device) -> None:
    """`tpc run --bf16` computes under CUDA's bf16 autocast only (the library's `interpret`
    also accepts CPU autocast, which tests use as a stand-in)."""
    if options.bf16 and device.type != "cuda":
        raise TpirError(Diagnostic("--bf16 needs CUDA", where="--bf16",
                                   hint="drop --bf16 on CPU (training runs in fp32 there)"))


@dataclass(frozen=True)
class CurriculumFlags:
    """`--curriculum SPEC --curriculum-type TYPE` (executors/curriculum.py)."""

    spec: str
    data_type: str = "seqlen_truncate"


@dataclass
class RunSetup:
    """What `tpc run` reads and checks before any training or communication, the same for both
    executors and for one plan or a bundle: the plans (a `PlanSet`), the model, the batches, the
    validation batches, the gradient check, and, under a curriculum, what it records and says.
    Every rank of a distributed run loads it alike, so all refuse a bad input alike."""

    plans: PlanSet
    options: RunOptions
    model: torch.nn.Module
    batches: object
    validation: object | None = None  # EvalBatches, with --eval-data
    gradient_check: "GradientCheck | None" = None
    curriculum: "CurriculumRun | None" = None

    @staticmethod
    def load(path: str, options: RunOptions, device: torch.device, *,
             curriculum: CurriculumFlags | None = None, interpreted: bool) -> "RunSetup":
        from tpc.ir.verify import verify_file

        run = None
        if curriculum is not None:
            run = CurriculumRun(path, options, curriculum.spec, curriculum.data_type,
                                options.comm_rules(device, interpreted=interpreted))
            plans = PlanSet(run.plans, run.length_of, curriculum=True)
            batches = run.batches(options)
        else:
            # the plan under the rules of the backend it will run on
            plan = verify_file(path, options.comm_rules(device, interpreted=interpreted))
            check_plan_model(plan)
            plans = PlanSet.single(plan)
            batches = batch_source(plan, options)
        for each in plans.plans.values():  # each plan of a curriculum's bundle alike
            check_documents_run(each, options)
        from tpc.executors.random_ltd_plan import run_options

        options = run_options(plans, options)  # the plan's random-LTD, if it records one
        check_tensor_run(plans.full, options, "the interpreter" if interpreted else "the distributed executor")
        check_bf16(options, device)
        # a rank of a distributed run builds only its stages' weights, later (distributed.py);
        # here the model without weights names them
        model = load_plan_model(plans.full, options.seed, weights=interpreted)
        check = GradientCheck(plans.full, options, model) if options.verify_grads else None
        validation = eval_batches(plans.full, options)  # read and checked before any training
        return RunSetup(plans, options, model, batches, validation, check, run)

    def reporter(self, rank: int) -> "Reporter":
        """The progress line and metrics of rank `rank` (rank 0 shows them)."""
        reporter = Reporter(self.options, self.plans.full, rank)
        if self.curriculum is not None:
            reporter.message(self.curriculum.describe())
        return reporter

    def checkpoints(self, say):
        """The run's checkpoints (and --init-from weights), or None."""
        from tpc.executors.training.run_checkpoints import RunCheckpoints

        record = self.curriculum.checkpoint_record() if self.curriculum is not None else None
        return RunCheckpoints.from_options(self.plans.full, self.options, say=say, model=self.model,
                                           curriculum=record)


def interpret_main(path: str, options: RunOptions, curriculum: CurriculumFlags | None = None) -> int:
    """`tpc run --interpret PLAN` (or `PLANS --curriculum SPEC`): every rank in this process, by
    the reference interpreter; print losses; check against autograd; write the trace."""
    from tpc.executors.interpreter import interpret

    setup = RunSetup.load(path, options, options.torch_device(), curriculum=curriculum, interpreted=True)
    options = setup.options  # with the plan's random-LTD
    reporter = setup.reporter(rank=0)
    result = interpret(setup.plans, options, model=setup.model, batches=setup.batches, on_step=reporter,
                       checkpoints=setup.checkpoints(reporter.message), verify=False,
                       eval_batches=setup.validation, on_eval=reporter.evaluation)
    reporter.close()
    if options.trace_path:
        write_trace(options.trace_path, result.events)
    check = setup.gradient_check
    if check is None:
        return 0
    worst, name, _ = check.compare_part(result.first_grads, setup.batches.get(0))
    return check.conclude(result.losses[0], [(worst, name, sorted(result.first_grads))])


class GradientCheck:
    """`--verify-grads`: the first step of a plan against plain autograd (see the module
    docstring). Built before training changes the model's weights."""

    def __init__(self, plan: Plan, options: RunOptions, model: torch.nn.Module):
        self.tolerance = options.tolerance
        self.plan, self.options = plan, options
        # over packed documents the reference runs each document on its own
        self.eos = plan.header.documents.eos if plan.header.documents is not None else None
        from tpc.compiler.frontend.weightless import holds_weights

        # the one place a distributed run builds the whole model: the seed gives it the weights
        # every rank's stages start from
        self.model = load_plan_model(plan, options.seed)
        if holds_weights(model):
            self.model.load_state_dict(model.state_dict())
        if options.init_from:  # the run starts from these weights: so does the reference
            from tpc.executors.training.init_from import init_model

            init_model(self.model, options.init_from)
        self._ref = None

    def reference(self, tokens: torch.Tensor):
        if self._ref is None:
            ltd = self.options.random_ltd
            self._ref = (batch_reference(self.model, tokens, self.eos) if ltd is None
                         else self._ltd_reference(ltd, tokens))
        return self._ref

    def _ltd_reference(self, ltd, tokens: torch.Tensor):
        """Random-LTD's oracle for step 0 (executors/random_ltd_oracle.py): the model's own
        blocks on the kept tokens every rank drew, micro-batch by micro-batch of every replica."""
        from tpc.compiler.frontend.plan_trace import sliced_for_header
        from tpc.executors.random_ltd_oracle import ltd_reference
        from tpc.executors.training.batches import replica_rows

        h = self.plan.header
        labels = sliced_for_header(copy.deepcopy(self.model), h).unit_labels
        rows = [(replica_rows(h, r)[0] + h.microbatch_rows(m)[0], mb.size, r, mb.lengths)
                for r in range(h.mesh.data) for m, mb in enumerate(h.microbatches)]
        ref = ltd_reference(self.model, tokens, ltd, labels, 0, rows)
        return ref

    def compare_part(self, grads: dict[str, torch.Tensor], tokens: torch.Tensor, shards=None, tensor_rank: int = 0):
        """(worst error, its parameter, names compared) over the parameters in `grads` (one
        rank's share, or all of them). `shards` (name -> ParamShard): the parameters `grads`
        holds tensor rank `tensor_rank`'s part of, compared with that part of autograd's."""
        ref = self.reference(tokens)
        shards = shards or {}

        def part(n):
            shard = shards.get(n)
            return ref.grads[n] if shard is None or shard.replicated else shard.take(ref.grads[n], tensor_rank)

        mine = {n: part(n) for n in grads if n in ref.grads}
        extra = sorted(set(grads) - set(ref.grads))
        if extra:
            return float("inf"), f"{extra[0]} is not a parameter of the model", set(grads)
        worst, name = gradient_error(grads, mine, floor=gradient_floor(ref.grads))
        return worst, name, set(grads)

    def conclude(self, loss: float, parts, show: bool = True) -> int:
        """Combine the ranks' (worst, name, names) parts; 1 when an error exceeds the tolerance
        (or a parameter that autograd gives a gradient is held by no stage), printed unless
        `show` is false."""
        ref = self._ref
        worst, name, _ = max(parts, key=lambda t: t[0])
        held = set().union(*(set(names) for _, _, names in parts))
        missing = sorted(set(ref.grads) - held - ref.unused)
        if missing:
            worst, name = float("inf"), f"{missing[0]} is held by no stage"
        return report_check(loss, ref.loss, worst, name, self.tolerance, show=show)


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


class Reporter:
    """After each step: the progress line on rank 0 (unless quiet) and, with `metrics`, one
    JSON line (docs/training.md). Steps are counted from 1 in both. Loss and tokens are the
    global batch's (the executors pass the loss summed over all ranks). The metrics file is
    opened at the first step this run makes: a fresh run starts it afresh; a resumed run keeps
    the rows up to the step it resumed at (a crashed run may have logged past its last
    checkpoint) and appends, so the file reads as one run."""

    def __init__(self, options: RunOptions, plan: Plan, rank: int):
        from tpc.executors.training.progress import Progress

        self.options = options
        self.tokens = plan.header.tokens_per_step
        self.progress = Progress(options.steps, quiet=options.quiet, rank=rank)
        self.write_metrics = bool(options.metrics) and rank == 0
        self.metrics = None

    def __call__(self, step: int, loss: float, info: dict) -> None:
        t = info["step_time"]
        val = info.get("val_loss")
        # a curriculum's steps differ in tokens; they say theirs, and their length
        tokens = info.get("tokens", self.tokens)
        seq = {"seq": info["seq"]} if "seq" in info else {}
        self.progress.update(step + 1, loss=loss, tokens=tokens, step_time=t, lr=info["lr"],
                             grad_norm=info["grad_norm"], val_loss=val)
        if self.write_metrics:
            if self.metrics is None:
                self.metrics = self._open(first_step=step)
            extra = {} if val is None else {"val_loss": val, "val_ppl": perplexity(val)}
            self.metrics.write(step + 1, loss=loss, lr=info["lr"], grad_norm=info["grad_norm"],
                               tokens_per_s=tokens / t if t > 0 else float("inf"), step_time=t,
                               **seq, **extra)

    def evaluation(self, done: int, val_loss: float) -> None:
        """An evaluation outside a step's line: before the first step (`done` = 0)."""
        from tpc.executors.training.progress import format_validation

        self.progress.message(f"validation after {done} steps: {format_validation(val_loss)}")
        if self.write_metrics:
            if self.metrics is None:
                self.metrics = self._open(first_step=done)
            self.metrics.write_eval(done, val_loss=val_loss, val_ppl=perplexity(val_loss))

    def _open(self, first_step: int):
        from tpc.executors.training.progress import MetricsWriter

        if self.options.resume:
            return MetricsWriter(self.options.metrics, append=True, keep_through=first_step)
        return MetricsWriter(self.options.metrics)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()


def write_trace(path: str, events) -> None:
    from tpc.compiler.predict.chrome_trace import write_trace_file
    from tpc.executors.engine import measured_trace

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace_file(out, measured_trace(events))
    print(f"trace: {path} ({len(events)} instructions)", file=sys.stderr)


# --------------------------------------------------------------------- curricula over bundles


class CurriculumRun:
    """A plan bundle and a curriculum over it, checked before any communication: the bundle
    (every plan and rules B1-B4), the lengths the curriculum asks for, the batches the data type
    needs, and the model file (executors/curriculum.py)."""

    def __init__(self, path: str, options: RunOptions, spec: str, data_type: str,
                 rules: CommRules = DEFAULT_COMM):
        """Every plan of the bundle is verified under `rules`, the rules the run follows."""
        from tpc.executors.curriculum import check_curriculum, parse_curriculum
        from tpc.ir.verify.bundle import load_bundle

        self.curriculum = parse_curriculum(spec)  # the flag's spelling first: no file is read
        self.bundle = load_bundle(path, rules)
        check_curriculum(self.curriculum, self.bundle, data_type)
        self.data_type = data_type
        used = self.curriculum.lengths_used(self.bundle.lengths)
        self.plans = {seq: self.bundle.plan(seq) for seq in used}
        # the full length: batches are drawn there; checkpoints and progress describe its plan
        self.full = self.bundle.plan(self.curriculum.end)
        check_plan_model(self.full)
        if options.verify_grads:
            raise TpirError(Diagnostic(
                "--verify-grads checks one plan's first step; with --curriculum check each plan of "
                "the bundle on its own", where="--verify-grads",
                hint=f"`tpc run --interpret {path}/seqL.tpir --verify-grads` for each length L"))

    def length_of(self, step: int) -> int:
        return self.curriculum.length(step, self.bundle.lengths)

    def batches(self, options: RunOptions):
        from tpc.executors.curriculum import CurriculumBatches

        return CurriculumBatches(batch_source(self.full, options), self.curriculum,
                                 self.bundle.lengths, self.data_type)

    def checkpoint_record(self) -> dict:
        return {"spec": self.curriculum.spec, "type": self.data_type, "length_of": self.length_of}

    def describe(self) -> str:
        """One line: the curriculum, and the steps at which it switches plans (up to 6)."""
        switches, last = [], None
        step, limit = 0, 10 ** 6
        while step < limit and len(switches) < 6:
            seq = self.length_of(step)
            if seq != last:
                switches.append(f"{seq} from step {step + 1}")
                last = seq
                if seq == self.curriculum.end:
                    break
            step += 1
        return (f"curriculum {self.curriculum.spec} ({self.data_type}): " + ", ".join(switches))
