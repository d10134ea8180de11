"""Random layerwise token dropping (random-LTD, DeepSpeed Data Efficiency) in a stage graph.

A dropped unit (a Transformer block) runs on a subset of its slice's tokens: the `keep_U`
placeholder holds their positions within the slice (int64, sorted, chosen by the caller:
`tpc.compiler.random_ltd`). The unit's input is gathered at those positions, the unit runs on
them, and its output is scattered back over its input: a token that is not kept skips the
block (its residual stream passes unchanged), so the next unit sees every token again.

How the unit's values are made from the gathered input:

* its data values (those computed from the tokens) are the unit's own nodes, copied with the
  gathered input in place of the full one; a size read off the sequence axis (`sym_size`) is
  the kept count, so reshapes to (batch, tokens, heads, dim) follow it;
* a static value over the sequence (positions, RoPE's cos/sin of the slice's window: computed
  from the slice's offset and full length, `positions.py`) is computed as for the whole slice
  and gathered at the kept positions along its token axis, so each kept token keeps its own
  position; a static size derived from the sequence length is recomputed from the kept count;
* causal attention over the KV cache (`runtime_ops.causal_attention`) masks bottom-right by
  sizes, so the kept tokens of a slice attend to the kept tokens of the earlier slices (the
  cache of a dropped unit holds those only) and to each other causally: among the kept tokens
  in order, DeepSpeed's top-left block of the causal mask for an unsliced sequence.

Refused, located: dropping the first or the last unit (the embeddings and the head run on
every token), a unit whose attention has a sliding window or a position bias (ALiBi): their
masks and biases are read by position, not by count.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpc.compiler.frontend import runtime_ops
from tpc.compiler.frontend.axes import node_token_axes
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import is_size_root
from tpc.compiler.frontend.flops import FREE
from tpc.ir.diagnostics import Diagnostic, TpirError

aten = torch.ops.aten


def check_droppable(ctx: PassContext, units) -> None:
    """Refuse a unit that cannot run on a subset of its tokens (the module docstring)."""
    last = len(ctx.units) - 1
    labels = [u.label for u in ctx.units]
    for u in units:
        if not 0 < u < last:
            raise TpirError(Diagnostic(
                f"random-LTD drops tokens in the middle units only; unit {u} ({labels[u] if 0 <= u <= last else '?'}) "
                f"is {'the first' if u == 0 else 'the last' if u == last else 'not a unit of the model'}",
                where="--random-ltd", hint=f"choose units between 1 and {last - 1} ({', '.join(labels[1:last])})"))
        for site, su in zip(ctx.cache_sites, ctx.site_units):
            if su != u:
                continue
            if site.per_slice:
                raise TpirError(Diagnostic(
                    f"unit {u} ({labels[u]}) runs a state-space scan, whose state passes through every token: "
                    "its tokens cannot be dropped", where="--random-ltd", hint="leave this unit out of --random-ltd"))
            if site.node.target is not runtime_ops.causal_attention:
                raise TpirError(Diagnostic(
                    f"unit {u} ({labels[u]}) runs a causal convolution or token shift, which reads the tokens "
                    "just before each token: its tokens cannot be dropped", where="--random-ltd",
                    hint="leave this unit out of --random-ltd"))
            kwargs = site.node.kwargs
            if site.window is not None or kwargs.get("bias") is not None:
                what = "a sliding window" if site.window is not None else "a position bias"
                raise TpirError(Diagnostic(
                    f"unit {u} ({labels[u]}) attends with {what}, which is read by position: its tokens "
                    "cannot be dropped", where="--random-ltd", hint="leave this unit out of --random-ltd"))


def copy_dropped_unit(ctx: PassContext, g: fx.Graph, unit, keep: fx.Node, env: dict, get, copy) -> None:
    """Copy `unit`'s nodes into `g` running on the tokens `keep` names (the module docstring):
    `env` maps the context's nodes to `g`'s, `get` resolves a node for a unit that keeps every
    token, `copy(node, resolve)` copies one node with another resolver. Leaves the scattered
    output in `env[unit.output]` and the kept tokens' values (its cached keys and values among
    them) in `env`."""
    full = env[unit.input] if unit.input in env else get(unit.input)
    kept_in = _free(g.call_function(aten.index_select.default, (full, 1, keep)))
    own: dict[fx.Node, fx.Node] = {}  # values of the kept tokens made for this unit

    def resolve(n: fx.Node) -> fx.Node:
        if n is unit.input:
            return kept_in
        if n in own:
            return own[n]
        if is_size_root(n, ctx.batch_sym, ctx.seq_sym):
            v = n.meta["val"]
            if v.node.expr == ctx.seq_sym:
                own[n] = _free(g.call_function(aten.sym_size.int, (kept_in, 1)))
                return own[n]
            return get(n)
        if n in ctx.static:
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt) and ctx.seq_sym in v.node.expr.free_symbols:
                own[n] = copy(n, resolve)  # a size made from the sequence length: the kept count
                return own[n]
            axes = node_token_axes(n, ctx.seq_sym)
            if isinstance(v, torch.Tensor) and axes:
                if len(axes) > 1:
                    raise TpirError(Diagnostic(
                        f"unit {unit.label} reads a static value over the sequence on {len(axes)} axes "
                        f"(`{n.name}`, a (T x T) table): random-LTD cannot gather it",
                        where="--random-ltd", hint=f"leave {unit.label} out of --random-ltd"))
                out = get(n)
                own[n] = _free(g.call_function(aten.index_select.default, (out, axes[0], keep)))
                return own[n]
            return get(n)
        return env[n] if n in env else get(n)

    for n in unit.nodes:
        if n.op == "placeholder":
            continue
        env[n] = copy(n, resolve)
    kept_out = env[unit.output]
    env[unit.output] = _free(g.call_function(aten.index_copy.default, (full, 1, keep, kept_out)))


def _free(node: fx.Node) -> fx.Node:
    node.meta["tpc_cost"] = FREE
    return node
