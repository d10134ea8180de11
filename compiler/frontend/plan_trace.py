"""The traced model of a plan: its model rebuilt, traced at the plan's shape, and checked to
cut into the plan's units.

A plan records the number of partition units the front end found (`units N`). Whoever re-traces
the model for a plan (the executors, the device cost model of `tpc simulate`) gets the same
cut only if the model file and torch's tracing have not changed; a trace that cuts the model
differently (a torch upgrade that moves a unit boundary) would run or price the plan on the
wrong split, so it is refused, located at the plan's `units` line.
"""

from __future__ import annotations

import torch

from tpc.compiler.frontend.sliced import SlicedModel
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header


def sliced_for_header(model: torch.nn.Module, header: Header, source: str = "") -> SlicedModel:
    """`SlicedModel` of `model` at the header's shape; a TpirError when it does not cut into
    the header's units. `source` is the plan file, for the message."""
    shape = header.shape
    # the numeric self-check ran when the plan was compiled, with its slices; the model file's
    # hash (checked by the caller) and the units below say the model is still that one
    sliced = SlicedModel.from_model(model, seq_len=shape.seq, vocab=shape.vocab, check_slices=None)
    units = header.units
    if sliced.num_units != units.count:
        raise TpirError(Diagnostic(
            f"the plan was compiled for {units.count} partition units, but {header.model.path} "
            f"now traces to {sliced.num_units} (torch {torch.__version__})",
            loc=units.loc, where=source,
            hint=f"recompile the plan with this torch and model file: "
                 f"`tpc compile {header.model.path} -o PLAN ...`"))
    return sliced
