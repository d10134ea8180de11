"""The front end's passes (compiler/frontend/context.py, sliced.py): small named passes over a
frozen, typed context, run by one loop that lints the graph after each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpc.compiler.frontend.capture import capture
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.sliced import PASSES, SlicedModel, initial_context, run_passes

from .harness import tiny_model

SEQ, VOCAB = 16, 256  # the examples' byte vocabulary


def test_the_passes_run_in_the_documented_order():
    assert [p.name for p in PASSES] == ["logits", "attention", "causal-state", "scan-state", "expert-dispatch",
                                        "token-independence",
                                        "positions", "units", "costs"]


def test_the_final_context_is_what_the_stages_are_cut_from():
    model = tiny_model("llama")
    sm = SlicedModel.from_model(model, seq_len=SEQ, vocab=VOCAB)
    ctx = sm.context
    assert isinstance(ctx, PassContext)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.units = ()  # passes return a new context; they do not write into this one
    assert len(ctx.units) == sm.num_units and len(ctx.attention) == 3 and ctx.states == ()
    assert [s.node for s in ctx.cache_sites] == [s.node for s in ctx.attention]
    assert list(ctx.site_units) == [1, 2, 3]  # one attention per block, after the embeddings
    assert ctx.offset in ctx.static and ctx.ids not in ctx.static
    assert all("tpc_cost" in n.meta for n in ctx.graph.nodes)
    whole = sm.stage_module(0, sm.num_units)
    assert whole.num_kv == 2 * len(ctx.attention)


def test_a_pass_that_breaks_the_graph_is_named():
    model = tiny_model("gpt")
    ctx = initial_context(model, capture(model, SEQ), SEQ, VOCAB)

    class Breaks:
        name = "breaks"

        def run(self, ctx):
            first = next(n for n in ctx.graph.nodes if n.op == "call_function")
            with ctx.graph.inserting_before(first):  # reads a value made after it
                ctx.graph.call_function(torch.ops.aten.neg.default, (first,))
            return ctx

    with pytest.raises(RuntimeError, match="after the front end's pass `breaks`"):
        run_passes(ctx, [Breaks()])
