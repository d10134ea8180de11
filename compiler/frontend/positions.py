"""Rewrite pass: absolute positions -> the slice's window [offset, offset + l).

A slice of length l starting at token `offset` sees only l tokens, so every static value (one
computed from sizes, parameters and buffers, not from the token ids) that runs over the
sequence must be the unsliced model's value at the plan's length L, cut to the slice's window:

* `arange(0, T)` becomes `arange(offset, offset + l)`, a buffer sliced `[:T]` (position tables,
  RoPE `freqs_cis`, cos/sin caches) becomes `[offset:offset + l]`: cheap, and exact;
* values that are the same at every position (`ones(T, C)`, an `expand` over T) need nothing;
* per-token ops of windowed values are windowed values themselves (RoPE's cos/sin of shifted
  positions, an embedding lookup of them);
* any other static value over the sequence (OPT's positions `cumsum(attention_mask) - 1`, an
  arange that does not start at 0, a reduction over positions) is computed at the full length L
  and cut to the window: exact for the plan, whose sequences are L tokens long, at the price of
  computing it at full length in every slice. Its inputs are recomputed at length L beside it.

`offset` is the context's graph placeholder holding a Python int (made with the context). A
(T x T) value left after the attention pass is a mask no recognised attention consumed: refused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tpc.compiler.frontend.analyse import mixing_reason
from tpc.compiler.frontend.axes import is_seq, node_token_axes
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import is_size_root, prune_dead
from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten

# factories whose value does not depend on positions, only on the shape they are given
_SHAPE_ONLY = {
    aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default,
    aten.expand.default,
}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _refuse(node, ctx, message, hint):
    raise refuse(node, ctx.model_file, message, hint)


def _shift(graph, offset, x):
    return graph.call_function(operator.add, (offset, x))


def _mentions_seq(x, ctx) -> bool:
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    return isinstance(v, torch.SymInt) and ctx.seq_sym in v.node.expr.free_symbols


class WindowPositions:
    """Every static value over the sequence is put on the slice's window (the module
    docstring); the values no longer used are dropped."""

    name = "positions"

    def run(self, ctx: PassContext) -> PassContext:
        rewrite_positions(ctx)
        prune_dead(ctx.graph)
        return ctx


def rewrite_positions(ctx: PassContext) -> None:
    """Put every static value of `ctx.graph` over the sequence on the slice's window
    `[ctx.offset, ctx.offset + l)`."""
    graph, offset = ctx.graph, ctx.offset
    shift, full_length = _classify(graph, ctx)
    for n in full_length:  # before the shifts: the clones read the unshifted originals
        _at_full_length(graph, n, offset, ctx)
    for n in shift:
        if n.target in _ARANGE:
            _window_arange(graph, n, offset, ctx)
        else:
            _window_slice(graph, n, offset, ctx)


def _classify(graph: fx.Graph, ctx) -> tuple[list[fx.Node], list[fx.Node]]:
    """(arange / slice nodes shifted in place, nodes computed at full length and cut)."""
    shift, full_length = [], []
    for n in graph.nodes:
        if n.op != "call_function" or n not in ctx.static or n.meta.get("tpc_kind") == "expert-dispatch":
            continue  # (the row numbers of an expert dispatch's inverse permutation: the slice's own)
        axes = node_token_axes(n, ctx.seq_sym)
        ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        ins_axes = any(node_token_axes(a, ctx.seq_sym) for a in ins)
        if not axes:
            if ins_axes and isinstance(n.meta.get("val"), torch.Tensor):
                full_length.append(n)  # a value reduced over positions (a sum, a max ...)
            continue
        if len(axes) > 1:
            _refuse(n, ctx, "a (tokens x tokens) value that is not the mask of a recognised causal attention",
                    "build causal attention with scaled_dot_product_attention(is_causal=True) or the "
                    "masked_fill(mask == 0, -inf) + softmax pattern")
        if n.target in _ARANGE and _plain_arange(n, ctx):
            shift.append(n)
        elif n.target is aten.slice.Tensor and not ins_axes and _plain_slice(n, ctx):
            shift.append(n)
        elif n.target in _SHAPE_ONLY and not any(_mentions_seq(a, ctx) for a in _fill_values(n)):
            continue  # the same at every position
        elif not ins_axes or mixing_reason(n, ctx.seq_sym) is not None:
            full_length.append(n)  # cumsum over positions, an arange from elsewhere, a shift ...
    return shift, full_length


def _fill_values(n: fx.Node) -> list:
    """The value arguments of a factory (not its sizes)."""
    if n.target in (aten.full.default, aten.new_full.default, aten.full_like.default):
        a = dict(zip([s.name for s in n.target._schema.arguments], n.args))
        return [a.get("fill_value")]
    return []


def _plain_arange(n, ctx) -> bool:
    names = [a.name for a in n.target._schema.arguments]
    a = dict(zip(names, n.args))
    return is_seq(a["end"], ctx.seq_sym) and a.get("start", 0) == 0 and a.get("step", 1) == 1


def _plain_slice(n, ctx) -> bool:
    a = dict(zip(["self", "dim", "start", "end", "step"], n.args))
    a.update(n.kwargs)
    return is_seq(a.get("end"), ctx.seq_sym) and a.get("start") in (None, 0) and a.get("step", 1) in (None, 1)


def _window_arange(graph, n, offset, ctx):
    names = [a.name for a in n.target._schema.arguments]
    a = dict(zip(names, n.args))
    with graph.inserting_before(n):
        lo, hi = offset, _shift(graph, offset, a["end"])
        # dtype and device as traced; a stage graph reads the device from its input (stage.py)
        new = graph.call_function(aten.arange.start, (lo, hi), dict(n.kwargs))
    new.meta = dict(n.meta)
    new.meta["tpc_kind"] = "position"
    n.replace_all_uses_with(new)
    graph.erase_node(n)


def _window_slice(graph, n, offset, ctx):
    a = dict(zip(["self", "dim", "start", "end", "step"], n.args))
    a.update(n.kwargs)
    with graph.inserting_before(n):
        hi = _shift(graph, offset, a["end"])
        new = graph.call_function(aten.slice.Tensor, (a["self"], a.get("dim", 0), offset, hi, 1))
    new.meta = dict(n.meta)
    new.meta["tpc_kind"] = "position"
    n.replace_all_uses_with(new)
    graph.erase_node(n)


def _seq_size(graph: fx.Graph, before: fx.Node, ctx) -> fx.Node:
    """A node before `before` holding the slice length (the ids' second size)."""
    for n in graph.nodes:
        if n is before:
            break
        if is_size_root(n, ctx.batch_sym, ctx.seq_sym) and is_seq(n, ctx.seq_sym):
            return n
    with graph.inserting_before(before):
        n = graph.call_function(aten.sym_size.int, (ctx.ids, 1))
    n.meta["val"] = ctx.ids.meta["val"].shape[1]
    return n


def _at_full_length(graph: fx.Graph, n: fx.Node, offset: fx.Node, ctx) -> None:
    """Replace `n` by its value at the plan's length L, cut to the slice's window."""
    L = ctx.seq_len
    depends: set[fx.Node] = {offset}
    for m in graph.nodes:  # the static values that change with the sequence length or offset
        if m is n:
            break
        if (is_size_root(m, ctx.batch_sym, ctx.seq_sym) and is_seq(m, ctx.seq_sym)) or \
                any(a in depends for a in m.all_input_nodes):
            depends.add(m)
    clones: dict[fx.Node, object] = {offset: 0}  # at full length the window starts at 0

    def at_L(m):
        if not isinstance(m, fx.Node) or m not in depends:
            return m
        if m not in clones:
            if is_size_root(m, ctx.batch_sym, ctx.seq_sym):
                clones[m] = L
            else:
                with graph.inserting_before(n):
                    c = graph.node_copy(m, at_L)
                c.meta = dict(m.meta)
                c.meta["tpc_kind"] = "full-length"
                clones[m] = c
        return clones[m]

    with graph.inserting_before(n):
        whole = graph.node_copy(n, at_L)
    whole.meta = dict(n.meta)
    whole.meta["tpc_kind"] = "full-length"
    axes = node_token_axes(n, ctx.seq_sym)
    if not axes:  # a value reduced over positions: the full-length value is the value
        n.replace_all_uses_with(whole)
        graph.erase_node(n)
        return
    length = _seq_size(graph, n, ctx)
    with graph.inserting_before(n):
        hi = _shift(graph, offset, length)
        cut = graph.call_function(aten.slice.Tensor, (whole, axes[0], offset, hi, 1))
    cut.meta = dict(n.meta)
    cut.meta["tpc_kind"] = "position"
    n.replace_all_uses_with(cut)
    graph.erase_node(n)
