"""`load_cost_model`: the one place that turns `--cost FILE` / `--device-model NAME` into a
CostModel for a given stage partition; `load_cost_source` into a CostSource that builds one for
any partition (the plan search tries several). A device model prices the traced model's graph
when it is given (`sliced`, what compile and simulate do), else a GPT of `ModelShapes`.

`tensor` is the tensor-parallel degree of every stage (`tpc compile --tensor T`): each model
prices a stage split over T ranks (graph.py, analytic.py: the `op` degree; profiled.py: a
profile measured unsplit, its compute divided by T and the collectives added)."""

from __future__ import annotations

from tpc.compiler.costmodel.analytic import AnalyticCostModel, ModelShapes
from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.costmodel.devices import load_device_spec
from tpc.compiler.costmodel.graph import GraphCostModel, GraphCosts, graph_cost_source
from tpc.compiler.costmodel.profiled import ProfiledCostModel
from tpc.compiler.costmodel.source import CostSource
from tpc.compiler.costmodel.store import load_profile
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.ir.diagnostics import Diagnostic, TpirError


def layers_per_stage(stage_units, num_units: int) -> tuple[int, ...]:
    """Decoder layers per stage when units are [embedding, layer 0, ..., layer n-1, head]."""
    last = num_units - 1
    return tuple(sum(1 for u in range(lo, hi) if 0 < u < last) for lo, hi in stage_units)


def _check_sources(cost, device_model, model_shapes, sliced=None) -> None:
    """Exactly one of a profile and a device model, and what the device model prices: the
    traced model (`sliced`) or, for a model too large to build, its shapes."""
    if cost and device_model:
        raise TpirError(Diagnostic("--cost and --device-model both given", where="--cost",
                                   hint="give one: a measured profile or an analytic device model"))
    if not cost and not device_model:
        raise TpirError(Diagnostic("no cost model", where="--cost",
                                   hint="give --cost FILE (from `tpc profile`) or --device-model "
                                        "v100|a100|h100|h200|SPEC.json"))
    if device_model and model_shapes is None and sliced is None:
        raise TpirError(Diagnostic("--device-model needs the traced model or its shapes", where="--device-model",
                                   hint="pass the SlicedModel (sliced=) or layers, hidden, heads and vocab "
                                        "(ModelShapes)"))


def load_cost_model(cost: str | None = None, device_model: str | None = None,
                    model_shapes: ModelShapes | None = None, stage_units=None,
                    num_units: int | None = None, tensor: int = 1,
                    model_sha256: str | None = None, device: str | None = None, sliced=None,
                    document_length: int | None = None, kept=None):
    """A cost model for the stages `stage_units` ([lo, hi) unit ranges, one per stage), each
    split over `tensor` ranks; `document_length`: rows of packed documents of that mean length,
    whose attention the traced-graph model prices by it (`costmodel/documents.py`).

    cost:          a profile from `tpc profile`; refused if `model_sha256` / `device` are given
                   and differ from what it measured.
    device_model:  v100 | a100 | h100 | h200 | a JSON spec, priced on the traced model `sliced`
                   (a SlicedModel: GraphCostModel, any model) or else on `model_shapes`
                   (AnalyticCostModel, a GPT; `num_units` maps units to layers: units are
                   embedding, the layers, the head).
    """
    _check_sources(cost, device_model, model_shapes, sliced)
    if cost:
        profile = load_profile(cost, model_sha256=model_sha256, device=device)
        units = stage_units if stage_units is not None else [(0, profile.num_units)]
        if units[-1][1] != profile.num_units:
            raise TpirError(Diagnostic(
                f"the profile has {profile.num_units} units, the stages cover {units[-1][1]}",
                where="--cost", hint="profile the model at the same sequence length and factory"))
        return ProfiledCostModel(profile, units, tensor)
    spec = load_device_spec(device_model)
    if sliced is not None:
        units = stage_units if stage_units is not None else [(0, sliced.num_units)]
        try:
            return GraphCostModel(spec, GraphCosts.from_sliced(sliced, document_length=document_length, kept=kept),
                                  units, tensor)
        except ValueError as e:
            raise TpirError(Diagnostic(str(e), where="--device-model",
                                       hint=f"stages must cover units 0:{sliced.num_units} in order"))
    if stage_units is None:
        stage_layers = (model_shapes.layers,)
    else:
        n = num_units if num_units is not None else model_shapes.layers + 2
        stage_layers = _stage_layers(stage_units, n, model_shapes)
    try:
        return AnalyticCostModel(spec, model_shapes, stage_layers, tensor)
    except ValueError as e:
        raise TpirError(Diagnostic(str(e), where="--device-model",
                                   hint="operator parallelism must divide heads and hidden"))


def _stage_layers(ranges, num_units: int, model_shapes: ModelShapes) -> tuple[int, ...]:
    """Layers per stage for the GPT-shapes model, whose units are [embedding, layers, head]."""
    layers = layers_per_stage(ranges, num_units)
    if sum(layers) != model_shapes.layers:
        raise TpirError(Diagnostic(
            f"stages hold {sum(layers)} layers, the model has {model_shapes.layers}",
            where="--device-model",
            hint="the analytic model expects units [embedding, one per layer, head]"))
    return layers


def load_cost_source(cost: str | None = None, device_model: str | None = None,
                     model_shapes: ModelShapes | None = None, num_units: int | None = None,
                     tensor: int = 1, model_sha256: str | None = None,
                     device: str | None = None, sliced=None, document_length: int | None = None,
                     kept=None) -> CostSource:
    """A CostSource for the options of `load_cost_model`: the profile is read (and checked)
    once, the device spec parsed (and the traced model's costs lambdified) once, and each
    partition's model built from them (at degree `tensor`; `CostSource.split` for another)."""
    _check_sources(cost, device_model, model_shapes, sliced)
    if cost:
        profile = load_profile(cost, model_sha256=model_sha256, device=device)
        if num_units is not None and num_units != profile.num_units:
            raise TpirError(Diagnostic(
                f"the profile has {profile.num_units} units, the model has {num_units}",
                where="--cost", hint="profile the model at the same sequence length and factory"))
        return CostSource(profile.num_units, lambda ranges, t: ProfiledCostModel(profile, ranges, t), tensor)
    if sliced is not None:
        return graph_cost_source(sliced, load_device_spec(device_model), tensor=tensor,
                                 document_length=document_length, kept=kept)
    n = num_units if num_units is not None else model_shapes.layers + 2
    whole = load_cost_model(device_model=device_model, model_shapes=model_shapes,
                            stage_units=[(0, n)], num_units=n, tensor=tensor)  # checks spec and shapes

    def build(ranges, t):
        return AnalyticCostModel(whole.device, model_shapes, _stage_layers(ranges, n, model_shapes), t)

    return CostSource(n, build, tensor)


def plan_cost_model(header, *, cost: str | None = None, device_model: str | None = None,
                    source: str = "") -> CostModel:
    """The cost model for a plan's own stages: unit costs scaled by slice length (neither
    option), the profile `cost` (checked against the plan's model), or the device model
    `device_model` pricing the traced graph of the plan's model (rebuilt from its file and
    checked to cut into the plan's units); split over the mesh's tensor ranks, with
    `sequence-parallel` its messages 1/T of a slice's tokens (`TokenParts`)."""
    model = _plan_cost_model(header, cost=cost, device_model=device_model, source=source)
    if header.mesh.sequence:
        from tpc.compiler.costmodel.base import TokenParts

        return TokenParts(model, header.mesh.tensor)
    return model


def _plan_cost_model(header, *, cost, device_model, source) -> CostModel:
    if not cost and not device_model:
        return UnitCosts.for_plan(header)
    ranges = [stage.units for stage in header.stages]
    tensor = header.mesh.tensor
    if cost:
        return load_cost_model(cost=cost, stage_units=ranges, num_units=header.units.count,
                               model_sha256=header.model.sha256, tensor=tensor)
    from tpc.compiler.frontend.plan_trace import sliced_for_header
    from tpc.compiler.frontend.weightless import build_weightless

    model, _ = build_weightless(header.model.path, header.model.factory)  # its graph prices it, not its weights
    sliced = sliced_for_header(model, header, source)
    return load_cost_model(device_model=device_model, sliced=sliced, stage_units=ranges, tensor=tensor,
                           document_length=header.documents.mean if header.documents is not None else None,
                           kept=kept_fractions(header))


def kept_fractions(header) -> dict[int, float] | None:
    """{unit: fraction of its tokens} a plan's `random-ltd` line prices (the schedule's mean
    kept count over the sequence: `RandomLTD.priced_fraction`), or None."""
    from tpc.compiler.random_ltd import from_line

    if header.random_ltd is None:
        return None
    ltd = from_line(header.random_ltd)
    return ltd.fractions(header.shape.seq)
