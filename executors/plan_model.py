"""The model a plan names: check its file, build it, trace it, and check that it still cuts
into the plan's units; and where each plan's stages come from (`StageSource`).

A plan records its model file's SHA-256 and the number of partition units the front end found
(`units N`). Both executors rebuild the model from the file and re-trace it; a changed file, or
a trace that cuts the model differently (a torch upgrade that moves a unit boundary,
`compiler/frontend/plan_trace.py`), would run the plan on the wrong split, so each is refused
with a located message before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tpc.compiler.frontend import SlicedModel, file_sha256, load_model
from tpc.compiler.frontend.model_file import MODEL_OBJECT
from tpc.compiler.frontend.plan_trace import sliced_for_header
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan


def check_plan_model(plan: Plan) -> None:
    """Refuse a model file that is missing or differs from the one the plan was compiled from."""
    line = plan.header.model
    if line.factory == MODEL_OBJECT:
        raise TpirError(Diagnostic(
            f"the plan was compiled from a model object in Python (tpc.compile(model, ...)), not from a "
            f"model file: `tpc run` cannot build it", loc=line.loc, where=plan.source,
            hint="run it from Python with the same model: `tpc.pipeline(plan, model)` (docs/library.md), or "
                 f"compile a model file: `tpc compile FILE -o PLAN`"))
    path = Path(line.path)
    if not path.is_file():
        raise TpirError(Diagnostic(
            f"the plan's model file {line.path!r} does not exist", loc=line.loc, where=plan.source,
            hint="run from the directory the plan was compiled in, or fix the path on the model line"))
    actual = file_sha256(path)
    if actual != line.sha256:
        raise TpirError(Diagnostic(
            f"the model file {line.path!r} has changed since the plan was compiled "
            f"(sha256 {actual[:12]}..., the plan says {line.sha256[:12]}...)",
            loc=line.loc, where=plan.source,
            hint=f"recompile: `tpc compile {line.path} -o PLAN ...`, or restore the file the plan was made from"))


def load_plan_model(plan: Plan, seed: int, *, weights: bool = True) -> torch.nn.Module:
    """The plan's model built from its file, with weights drawn after `torch.manual_seed(seed)`,
    so every process that builds it gets the same weights. `weights=False`: without any, every
    parameter on the meta device (what a rank traces, and what names the model's parameters)."""
    if not weights:
        from tpc.compiler.frontend.weightless import build_weightless

        return build_weightless(plan.header.model.path, plan.header.model.factory)[0]
    torch.manual_seed(seed)
    return load_model(plan.header.model.path, plan.header.model.factory)


def rank_parameter_names(plans, sliced: dict, pipe_rank: int) -> set[str]:
    """The parameters the stages of pipeline rank `pipe_rank` use, in every plan of `plans`
    (a PlanSet; `sliced`: length -> SlicedModel)."""
    names: set[str] = set()
    for seq, plan in plans.plans.items():
        h = plan.header
        for s in h.stages_of_rank(pipe_rank):
            lo, hi = h.stages[s].units
            names |= sliced[seq].stage_param_names(lo, hi)
    return names


def load_rank_model(plan: Plan, seed: int, names) -> torch.nn.Module:
    """The plan's model holding only the parameters `names` (the others on the meta device),
    each equal to what `load_plan_model(plan, seed)` gives it (compiler/frontend/weightless.py)."""
    from tpc.compiler.frontend.weightless import build_holding

    return build_holding(plan.header.model.path, plan.header.model.factory, seed, names)


def slice_model(model: torch.nn.Module, plan: Plan) -> SlicedModel:
    """The front end's `SlicedModel` of `model` at the plan's shape; refused when its trace cuts
    the model into another number of units than the plan was compiled for."""
    return sliced_for_header(model, plan.header, plan.source)


@dataclass(frozen=True)
class StageSource:
    """Where the stages of each plan of a run come from, for both executors: the front end's
    sliced model of the plan's length, cut from a rank's copy of the model (`sliced`, by
    length), or a stand-in (`factory_for(model_copy) -> StageFactory`, with its `hidden`
    size: tests)."""

    sliced: dict | None = None
    factory_for: Callable | None = None
    hidden: int | None = None

    @staticmethod
    def of(plans, model, *, sliced=None, factory_for=None, hidden_size: int | None = None) -> "StageSource":
        """`plans`: a PlanSet. `sliced`: one sliced model (the longest plan's) or a mapping
        length -> sliced model; the plans it lacks are traced from `model` now."""
        if factory_for is not None:
            if hidden_size is None:
                raise TpirError(Diagnostic("the hidden size of the model is unknown",
                                           hint="pass hidden_size with a stand-in stage factory"))
            return StageSource(factory_for=factory_for, hidden=hidden_size)
        if sliced is not None and not isinstance(sliced, dict):
            sliced = {plans.full.header.shape.seq: sliced}
        given = dict(sliced or {})
        return StageSource(sliced={seq: given.get(seq) or slice_model(model, p) for seq, p in plans.plans.items()})

    def stages(self, plan: Plan, model_copy, evaluation: bool = False, options=None, tensor=None):
        """The StageFactory of `plan`'s stages over `model_copy`'s parameters (`evaluation`: as
        `model.eval()` runs them, for the evaluation program), each run as `options` (RunOptions)
        and the plan say (`engine.programs_for`). `tensor`: the rank's `TensorRank` on a mesh
        with a tensor axis (executors/tensor_ranks.py): its part of each stage."""
        if self.factory_for is not None:
            if evaluation:
                raise TpirError(Diagnostic("evaluation needs the model's front end (`sliced`)",
                                           hint="run with the plan's model, not a stand-in stage factory"))
            if tensor is not None:
                raise TpirError(Diagnostic("a tensor axis needs the model's front end (`sliced`)",
                                           hint="run with the plan's model, not a stand-in stage factory"))
            return self.factory_for(model_copy)
        ltd = getattr(options, "random_ltd", None)
        if tensor is not None and ltd is not None:
            raise TpirError(Diagnostic("random-LTD does not run on a mesh with a tensor axis",
                                       where="--random-ltd", hint="compile the plan without --tensor"))
        from tpc.executors.engine import programs_for, stage_factory_from_model
        from tpc.executors.options import RunOptions

        if tensor is not None:
            from tpc.executors.tensor_ranks import tensor_stage_factory

            return tensor_stage_factory(self.sliced[plan.header.shape.seq], model_copy, tensor, evaluation,
                                        programs=programs_for(plan, options or RunOptions()))

        return stage_factory_from_model(self.sliced[plan.header.shape.seq], model_copy, evaluation=evaluation,
                                        programs=programs_for(plan, options or RunOptions()),
                                        dropped=() if evaluation or ltd is None else tuple(ltd.units),
                                        documents=plan.header.documents is not None)

    def hidden_size(self, plan: Plan) -> int:
        return self.hidden if self.factory_for is not None else self.sliced[plan.header.shape.seq].hidden_size
