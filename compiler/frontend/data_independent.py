"""Static values: those computed from parameters, buffers, sizes and the slice offset only, never
from the token data. Position tables, masks and weight views are static; a stage recomputes the
static values it needs instead of receiving them, so they never cross a stage cut.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from tpc.compiler.frontend.axes import size_expr


def is_size_root(n: fx.Node, batch_sym, seq_sym) -> bool:
    """`sym_size` of the batch or sequence axis: re-read from each stage's own input."""
    if n.op != "call_function" or n.target is not torch.ops.aten.sym_size.int:
        return False
    v = n.meta.get("val")
    return isinstance(v, torch.SymInt) and v.node.expr in (batch_sym, seq_sym)


def static_nodes(graph: fx.Graph, batch_sym, seq_sym, data_inputs: set[fx.Node]) -> set[fx.Node]:
    """Nodes whose value depends on no data input (nodes in `data_inputs` are data)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n in data_inputs or n.op == "output":
            continue
        if n.op == "get_attr" or is_size_root(n, batch_sym, seq_sym):
            out.add(n)
        elif n.op == "placeholder":
            if n.target == "offset":
                out.add(n)
        elif n.op == "call_function" and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def evaluate(node: fx.Node, sizes: dict, fetch, offset: int = 0, cache=None):
    """Evaluate a static node for concrete sizes ({symbol: int}); `fetch(name)` gives attributes."""
    cache = {} if cache is None else cache
    if node in cache:
        return cache[node]
    if node.op == "get_attr":
        val = fetch(node.target)
    elif node.op == "placeholder":
        val = offset
    elif node.target is torch.ops.aten.sym_size.int:
        val = int(size_expr(node.meta["val"]).subs(sizes))
    else:
        ev = lambda a: evaluate(a, sizes, fetch, offset, cache)  # noqa: E731
        args = fx.node.map_arg(node.args, ev)
        kwargs = fx.node.map_arg(node.kwargs, ev)
        val = node.target(*args, **kwargs)
    cache[node] = val
    return val




def prune_dead(graph: fx.Graph) -> None:
    """Remove every call whose value is unused. Unlike `eliminate_dead_code`, this also drops an
    unused dropout (marked random, hence impure): the captured graphs have no side effects."""
    for n in reversed(list(graph.nodes)):
        # (a scan's final state is read by the next slice, not by this slice's graph: `ssm_state.py`)
        if n.op in ("call_function", "get_attr") and not n.users and n.meta.get("tpc_kind") != "carried-out":
            graph.erase_node(n)
