"""Rewrite pass: absolute positions -> the slice's window [offset, offset + l).

A slice of length l starting at token `offset` sees only l tokens, so every value computed from
absolute positions must be shifted: `arange(0, T)` becomes `arange(offset, offset + l)`, a buffer
sliced `[:T]` (position tables, RoPE `freqs_cis`, cos/sin caches) becomes `[offset:offset + l]`.
Values derived from these (scaled positions, reshaped tables) follow automatically. `offset` is a
new graph placeholder holding a Python int.

Any other static value with a token axis must not depend on positions (`ones(T, C)` is fine); a
(T x T) value left after the attention pass is a mask no recognised attention consumed, and a
position computed another way would be silently wrong: both are refused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tpc.compiler.frontend.axes import is_seq, node_token_axes
from tpc.compiler.frontend.locate import loc_of_node, where_of_node
from tpc.ir.diagnostics import Diagnostic, TpirError

aten = torch.ops.aten

# factories whose value does not depend on positions, only on the shape they are given
_SHAPE_ONLY = {
    aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _refuse(node, ctx, message, hint):
    loc = loc_of_node(node, ctx.model_file)
    raise TpirError(Diagnostic(message, loc=loc, where="" if loc else where_of_node(node), hint=hint))


def _shift(graph, offset, x):
    return graph.call_function(operator.add, (offset, x))


def rewrite_positions(graph: fx.Graph, ctx) -> fx.Node:
    """Shift every position source by the slice offset; returns the `offset` placeholder."""
    with graph.inserting_after(ctx.ids):
        offset = graph.placeholder("offset")
    offset.meta["val"] = 0
    ctx.static.add(offset)
    for n in list(graph.nodes):
        if n.op != "call_function" or n not in ctx.static or not node_token_axes(n, ctx.seq_sym):
            continue
        ins_axes = any(node_token_axes(a, ctx.seq_sym) for a in n.all_input_nodes)
        if n.target in _ARANGE:
            _window_arange(graph, n, offset, ctx)
        elif n.target is aten.slice.Tensor and not ins_axes:
            _window_slice(graph, n, offset, ctx)
        elif len(node_token_axes(n, ctx.seq_sym)) > 1:
            _refuse(n, ctx, "a (tokens x tokens) value that is not the mask of a recognised causal attention",
                    "build causal attention with scaled_dot_product_attention(is_causal=True) or the "
                    "masked_fill(mask == 0, -inf) + softmax pattern")
        elif not ins_axes and n.target not in _SHAPE_ONLY:
            _refuse(n, ctx, f"a value with a token axis is computed from sizes by `{n.target}`, which the "
                            "front end cannot shift to a slice's positions",
                    "compute positions with torch.arange(T) or by slicing a buffer with [:T]")
    graph.lint()
    return offset


def _window_arange(graph, n, offset, ctx):
    names = [a.name for a in n.target._schema.arguments]
    a = dict(zip(names, n.args))
    start, end, step = a.get("start", 0), a["end"], a.get("step", 1)
    if not (is_seq(end, ctx.seq_sym) and start == 0 and step == 1):
        _refuse(n, ctx, "positions from an arange other than arange(T) / arange(0, T)",
                "write positions as torch.arange(0, T) with T the sequence length")
    with graph.inserting_before(n):
        lo, hi = offset, _shift(graph, offset, end)
        # dtype and device as traced; a stage graph reads the device from its input (stage.py)
        new = graph.call_function(aten.arange.start, (lo, hi), dict(n.kwargs))
    new.meta = dict(n.meta)
    new.meta["tpc_kind"] = "position"
    n.replace_all_uses_with(new)
    graph.erase_node(n)


def _window_slice(graph, n, offset, ctx):
    names = ["self", "dim", "start", "end", "step"]
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    start, end, step = a.get("start"), a.get("end"), a.get("step", 1)
    if not (is_seq(end, ctx.seq_sym) and start in (None, 0) and step in (None, 1)):
        _refuse(n, ctx, "a buffer sliced by the sequence length other than as buf[:T]",
                "slice position tables as table[:T] (the front end shifts this to the slice's window)")
    with graph.inserting_before(n):
        hi = _shift(graph, offset, end)
        new = graph.call_function(aten.slice.Tensor, (a["self"], a.get("dim", 0), offset, hi, 1))
    new.meta = dict(n.meta)
    new.meta["tpc_kind"] = "position"
    n.replace_all_uses_with(new)
    graph.erase_node(n)
