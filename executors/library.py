"""tpc as a library: compile a model (object or file) into a plan, load a plan, and build this
process's `Pipeline` of it, from a user's own training script. `import tpc` re-exports these
(tpc/__init__.py); docs/library.md is the guide.

    plan = compile(model, seq_len=256, batch=16, stages=2, microbatches=4, slices=2)
    pipe = pipeline(plan, model)                   # under torchrun: this rank's stages
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    loss = pipe.step(inputs, targets)               # one step: every micro-batch and slice
    pipe.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

Under torchrun every process calls the same functions with the same arguments; `pipeline`
joins the process group (gloo on the CPU, NCCL on CUDA) unless the script already did. Outside
torchrun a plan of one rank runs in the process; a plan of several runs there only with
`interpret=True` (the reference interpreter: every rank in this process, for checking).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tpc.compiler.frontend.model_file import MODEL_OBJECT, model_source, with_forward
from tpc.executors.options import RunOptions
from tpc.executors.pipeline import Pipeline, PlanSet, check_optimizer
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.verify.bundle import LoadedBundle

__all__ = ["compile", "load", "pipeline", "with_forward", "Pipeline", "Plan", "LoadedBundle"]


def compile(model: "torch.nn.Module | str | os.PathLike", *, seq_len: "int | tuple[int, ...]", batch: int,
            output: str | None = None, quiet: bool = True, constant_tokens: bool = False,
            **options) -> "Plan | LoadedBundle":
    """Compile `model` into a verified plan with the options of `tpc compile` (docs/compile.md),
    spelled as keyword arguments: `stages=2`, `microbatches=4`, `slices=2` or `(24, 40)`,
    `schedule="1f1b"`, `dp=2`, `tensor=2`, `cost="profile.json"`, ... `model` is a model object
    (compiled as it is; its forward takes (B, T) token ids and returns (B, T, V) logits: see
    `with_forward`), or the path of a model file or of a Hugging Face config.json. With
    `output`, the plan is also written there (atomically, after it is read back and verified).
    `quiet=False` shows the passes' progress.

    Several lengths (`seq_len=(64, 128, 256)`) compile a plan bundle into the folder `output`:
    one plan per length on one stage split (docs/training.md, "Plan bundles"; with
    `constant_tokens`, the batch shrinks as the length grows), returned as a `LoadedBundle`,
    whose pipeline steps each batch with the plan of its length."""
    from tpc.compiler.compile import compile_plan
    from tpc.compiler.options import check_options

    path, obj = _given(model, options)
    lengths = tuple(seq_len) if isinstance(seq_len, (tuple, list)) else (seq_len,)
    # the user's random streams are left as they were: a script that draws its batches after
    # compiling draws the same ones as without tpc
    with torch.random.fork_rng(devices=[]):
        if "schedule_file" in options:
            plan = _compile_schedule_file(path, obj, lengths, batch, quiet, options)
            if output is not None:
                from tpc.compiler.pipeline import write_plan

                write_plan(plan, output, quiet=quiet)
            return plan
        if len(lengths) > 1 or constant_tokens:
            return _compile_bundle(path, obj, lengths, batch, output, quiet, constant_tokens, options)
        return compile_plan(path, _options(check_options, seq_len=seq_len, batch=batch, quiet=quiet, **options),
                            output=output, model=obj)


def _given(model, options: dict) -> tuple[str, "torch.nn.Module | None"]:
    """(the path a plan names, the model object or None) of what `compile` was given; a model
    object's plan names its class's file and the factory MODEL_OBJECT."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), None
    if not isinstance(model, torch.nn.Module):
        raise TpirError(Diagnostic(f"compile(): the model is a {type(model).__name__}",
                                   hint="pass a torch.nn.Module, or the path of a model file"))
    if "factory" in options:
        raise TpirError(Diagnostic("compile(model, factory=...): a factory names a callable of a model file",
                                   hint="pass the model file's path with factory=, or the model object alone"))
    options["factory"] = MODEL_OBJECT
    return model_source(model), model


def _options(check, **given):
    """`check(**given)`, an unknown keyword said as a located error."""
    try:
        return check(**given)
    except TypeError as e:
        raise TpirError(Diagnostic(f"compile(): {e}", hint="the options are `tpc compile`'s, e.g. stages=2, "
                                   "microbatches=4, slices=2, schedule='1f1b' (docs/compile.md)")) from None


def _compile_schedule_file(path: str, obj, lengths, batch, quiet, options) -> Plan:
    """`tpc compile --schedule-file CSV`: the plan of a torch.distributed.pipelining schedule
    CSV (docs/torch-pipelining.md); the other options it takes are `microbatches`, `slices`,
    `dp`, `stages` and `factory`."""
    from tpc.compiler.optimise.slicing import AUTO
    from tpc.compiler.options import parse_slices
    from tpc.compiler.torch_schedule.compile import compile_schedule_file

    options = dict(options)
    csv = os.fspath(options.pop("schedule_file"))
    known = {"microbatches", "slices", "dp", "stages", "factory"}
    if set(options) - known or len(lengths) != 1:
        extra = sorted(set(options) - known) or ["several lengths"]
        raise TpirError(Diagnostic(f"compile(schedule_file=...): {', '.join(extra)} with a schedule file",
                                   hint=f"a schedule file takes seq_len (one), batch, {', '.join(sorted(known))}"))
    slices = parse_slices(options.pop("slices", 1), lengths[0])
    if slices == AUTO:
        raise TpirError(Diagnostic("compile(schedule_file=..., slices='auto'): the schedule file fixes the "
                                   "units of work", hint="give a slice count or lengths"))
    return compile_schedule_file(path, csv, seq_len=lengths[0], batch=batch, slices=slices, quiet=quiet,
                                 model=obj, **options)


def _compile_bundle(path: str, obj, lengths, batch, output, quiet, constant_tokens, options) -> "LoadedBundle":
    from tpc.compiler.bundle import check_lengths, compile_bundle
    from tpc.compiler.options import check_options

    if output is None:
        raise TpirError(Diagnostic(f"compile(seq_len={lengths}): a plan bundle is written into a folder",
                                   hint="pass output='plans' (the folder is created)"))
    lengths = tuple(sorted(lengths))
    check_lengths(lengths, options.get("slices"))
    opts = _options(check_options, seq_len=lengths[-1], batch=batch, quiet=quiet, **options)
    return compile_bundle(path, output, opts, lengths, constant_tokens=constant_tokens, model=obj)


def load(path: "str | os.PathLike") -> "Plan | LoadedBundle":
    """Read and verify a `.tpir` plan, or a plan bundle's folder (under NCCL's rules, which
    every backend's plan obeys)."""
    from tpc.ir.verify import verify_file
    from tpc.ir.verify.bundle import is_bundle, load_bundle

    path = os.fspath(path)
    return load_bundle(path) if is_bundle(path) else verify_file(path)


def pipeline(plan: "Plan | LoadedBundle | str | os.PathLike", model: torch.nn.Module | None = None, *, device: str = "auto",
             interpret: bool = False, seed: int = 0, timeout: float = 120.0, compile: bool = False,
             bf16: bool = False, quiet: bool = True, slice_pairs: bool = True) -> Pipeline:
    """This process's part of `plan` (a Plan, a plan bundle, or the path of either), ready to
    step; a bundle's pipeline steps each batch with the plan of its length.

    `model`: the model the plan was compiled from, with its weights (every process builds it
    the same way, e.g. after the same `torch.manual_seed`); under torchrun this rank's stages
    train its parameters themselves (the same tensors). None: the plan's model file is built
    here with the weights of `seed`, this rank's parameters only (a plan compiled from an
    object needs the object). `device`: cpu, cuda or auto (cuda:LOCAL_RANK when CUDA is
    present). `interpret`: every rank of the plan in this process (the reference
    interpreter; outside torchrun). `compile`: the stages' programs compiled with
    torch.compile before the first step (`quiet=False` shows each rank's progress through them,
    which can take minutes); `bf16`: bf16 autocast (CUDA). `timeout`: seconds a rank waits for a
    peer. `slice_pairs=False`: with a tensor axis, every slice's compute alone (`tpc run
    --no-slice-pairs`)."""
    if not isinstance(plan, (Plan, LoadedBundle)):
        plan = load(plan)
    # a bundle: one plan per length, sharing the weights; each step runs its batch's length
    plans = (PlanSet({p.header.shape.seq: p for p in plan.plans}, lambda step: plan.lengths[-1])
             if isinstance(plan, LoadedBundle) else PlanSet.single(plan))
    plan = plans.full
    # "cuda:1" as a script may spell it: each rank computes on cuda:LOCAL_RANK
    options = RunOptions(seed=seed, device=str(device).split(":")[0], timeout=timeout, compile=compile, bf16=bf16,
                         external_optimizer=True, lr_schedule="constant", quiet=quiet, slice_pairs=slice_pairs)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TpirError(Diagnostic(f"pipeline(plan, model): the model is a {type(model).__name__}",
                                   hint="pass the torch.nn.Module the plan was compiled from"))
    if model is None and plan.header.model.factory == MODEL_OBJECT:
        raise TpirError(Diagnostic(
            "pipeline(plan): this plan was compiled from a model object; pass the object",
            loc=plan.header.model.loc, where=plan.source, hint="pipeline(plan, model)"))
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    size = plan.header.mesh.value.size
    if interpret or (not under_torchrun and size == 1):
        with torch.random.fork_rng(devices=[]):
            pipe, sliced = _interpreted(plans, model, options)
    elif not under_torchrun:
        mesh = plan.header.mesh.value
        raise TpirError(Diagnostic(
            f"this plan runs on {size} ranks ({mesh.describe()}) "
            "but this process was not started by torchrun", where=plan.source,
            hint=f"start the script with `torchrun --nproc-per-node {size} SCRIPT`, or pass interpret=True to "
                 "run every rank in this process (the reference interpreter: slow, for checking)"))
    else:
        with torch.random.fork_rng(devices=[]):
            pipe, sliced = _distributed(plans, model, options)
    if model is not None:
        _watch_optimizers(pipe, model, sliced)
    return pipe


def _interpreted(plans: PlanSet, model, options: RunOptions) -> Pipeline:
    from tpc.executors.interpreter import Interpreted
    from tpc.executors.plan_model import StageSource, load_plan_model
    from tpc.executors.tensor_ranks import check_tensor_run
    from tpc.ir.semantics import NCCL
    from tpc.ir.verify import check

    full = plans.full
    device = options.torch_device()
    rules = options.comm_rules(device, interpreted=True)
    for p in plans.plans.values():
        check(p, rules)
    check_tensor_run(full, options, "the interpreter")
    if model is None:
        model = load_plan_model(full, options.seed)
    stages = StageSource.of(plans, model)
    executor = Interpreted(options, device, model, stages, rules == NCCL, mesh=full.header.mesh)
    pipe = Pipeline(plans, executor, evaluation=full.eval is not None)
    executor.start()
    return pipe, stages.sliced[full.header.shape.seq]


def _distributed(plans: PlanSet, model, options: RunOptions) -> Pipeline:
    from tpc.compiler.frontend.weightless import move_real
    from tpc.executors.distributed import Distributed
    from tpc.executors.plan_model import StageSource, check_plan_model, load_rank_model, rank_parameter_names, slice_model
    from tpc.executors.tensor_ranks import check_tensor_run
    from tpc.executors.world import World, check_world, init
    from tpc.ir.verify import check

    import torch.distributed as dist

    full = plans.full
    world = World.from_env()
    check_world(full, world)
    device = options.torch_device(world.local_rank)
    for p in plans.plans.values():
        check(p, options.comm_rules(device))
    check_tensor_run(full, options, "the distributed executor")
    sliced = None
    if model is None:
        check_plan_model(full)
        from tpc.executors.plan_model import load_plan_model

        names_of = load_plan_model(full, options.seed, weights=False)
        sliced = {seq: slice_model(names_of, p) for seq, p in plans.plans.items()}
        names = rank_parameter_names(plans, sliced, full.header.mesh.value.pipe_rank(world.rank))
        model = move_real(load_rank_model(full, options.seed, names), device)
    elif any(p.device != device for p in model.parameters()):
        model.to(device)
    joined = not dist.is_initialized()
    init(world, device, options.timeout)
    stages = StageSource.of(plans, model, sliced=sliced)
    executor = Distributed(world, options, device, plans, stages=stages, model=model)
    executor.leave_group = joined
    pipe = Pipeline(plans, executor, evaluation=full.eval is not None)
    executor.start()
    return pipe, stages.sliced[full.header.shape.seq]


_hooked = False


def _watch_optimizers(pipe: Pipeline, model: torch.nn.Module, sliced) -> None:
    """Remember `model`'s parameters and which pipeline rank trains each, so that an optimizer
    over parameters this process does not train is refused at its first step
    (`pipeline.check_optimizer`, run before every optimizer's step in this process)."""
    global _hooked
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    h = pipe.plans.full.header
    holders: dict[str, int] = {}
    for stage in h.stages:
        lo, hi = stage.units
        for n in sorted(sliced.stage_param_names(lo, hi)):
            holders.setdefault(n, h.stage_ranks(stage.index)[0])
    if pipe.interpreted:  # every rank trains copies of the model's parameters
        holders = {}
    pipe.model_names, pipe.holders = names, holders
    if not _hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda opt, args, kwargs: check_optimizer(opt))
        _hooked = True
