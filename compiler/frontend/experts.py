"""Mixture-of-experts dispatch: a permutation of the tokens that is undone, recognised as token-local.

A mixture-of-experts layer routes each token to its top-k experts. Implementations group the
(token, expert) pairs by expert to run each expert once over its rows (Hugging Face's
`grouped_mm` experts, `transformers/integrations/moe.py`):

    ids = topk(router(x)).indices.reshape(-1)          # (N * k,) one expert per pair
    sorted_ids, perm = sort(ids)                        # the pairs grouped by expert
    rows = x[perm // k]                                 # gather: the pairs' tokens, grouped
    offs = cumsum(histc(sorted_ids, E))                 # where each expert's group ends
    y = grouped_mm(act(grouped_mm(rows, w_up, offs)), w_down, offs) * weights[perm]
    inv = empty_like(perm); inv[perm] = arange(N * k)   # the inverse permutation
    out = y[inv].view(N, k, H).sum(1)                   # back in token order, summed over k

The sort reorders along the (flattened) tokens and the offsets count over all of them, so the
token-independence rules would refuse it; yet each row of `y` is its own token's row times its
own expert's weights, and `y[inv]` puts every row back where it came from, so a token's output
depends on that token alone: slicing the tokens changes which rows sit together, not their
values. Recognised here, from each `sort` (or `argsort`) along a token axis:

* the region: every value computed from the permutation or the sorted ids, up to the nodes that
  undo it: `y[inv]` with `inv` the inverse permutation (`inv[perm] = arange(n)`, or
  `argsort(perm)`), or a scatter back into token order (`index_add` / `index_put(accumulate)` /
  `scatter_add` at `perm // k`);
* in the region, gathers into it indexed by the permutation (`x[perm // k]`, `w[perm]`), the
  offsets (reductions of the sorted ids: `histc`, `bincount`, `cumsum`) used only as a grouped
  matmul's offsets, grouped matmuls (`transformers::grouped_mm_fallback`, `aten::_grouped_mm`),
  and per-row ops (anything the token-independence rules let through);
* no op of the region joins its rows with a value in token order (other than the gathers).

Its nodes get `meta["tpc_kind"] = "expert-dispatch"`, which the token-independence and
positions passes leave alone. Anything else in the region is refused at its line. The numeric
self-check (sliced against unsliced, forward and backward) then confirms the layer.

Not recognised, and refused by the token-independence rules at their line: routing limited by
an expert's capacity, which drops the tokens past it by their rank in the whole sequence (a
`cumsum` of the assignments along the tokens): a slice ranks its tokens differently.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tpc.compiler.frontend.analyse import mixing_reason
from tpc.compiler.frontend.axes import node_token_axes
from tpc.compiler.frontend.calls import op_name
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten
KIND = "expert-dispatch"

_SORTS = {"sort", "argsort"}
_COUNTS = {"histc", "bincount", "cumsum", "to", "_to_copy", "div", "floor_divide", "sub", "add", "mul"}
_GROUPED = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}
_SCATTER_BACK = {"index_add", "scatter_add", "index_put", "_index_put_impl", "scatter_reduce"}


def _perm_and_sorted(s: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(permutation nodes, sorted-value nodes) of a sort or argsort."""
    if op_name(s) == "argsort":
        return [s], []
    perms = [u for u in s.users if u.target is operator.getitem and u.args[1] == 1]
    vals = [u for u in s.users if u.target is operator.getitem and u.args[1] == 0]
    return perms, vals


def _derived_from(n: fx.Node, roots: set) -> bool:
    """Whether n is one of `roots` or an elementwise function of one with constants
    (`perm // k`, casts)."""
    while isinstance(n, fx.Node):
        if n in roots:
            return True
        if op_name(n) not in ("floor_divide", "div", "to", "_to_copy", "remainder") or not n.args:
            return False
        n = n.args[0]
    return False


def _inverse_of(n: fx.Node, perm: set) -> bool:
    """Whether n is the inverse permutation of a node of `perm`: `inv[perm] = arange(n)` on a
    fresh tensor, or `argsort(perm)`."""
    name = op_name(n)
    if name == "argsort":
        return n.args[0] in perm
    if name in ("index_put", "_index_put_impl"):
        base, idx, val = n.args[:3]
        fresh = op_name(base) in ("empty_like", "zeros_like", "empty", "zeros", "new_empty", "new_zeros")
        return (fresh and len(idx) == 1 and idx[0] in perm and isinstance(val, fx.Node)
                and op_name(val) == "arange" and not (len(n.args) > 3 and n.args[3]))
    return False


def _undoes(n: fx.Node, perm: set, inverses: set) -> bool:
    """Whether n puts the region's rows back into token order."""
    name = op_name(n)
    if name == "index" and len(n.args[1]) == 1 and n.args[1][0] in inverses:
        return True
    if name in ("index_add", "scatter_add") and len(n.args) >= 3:
        return _derived_from(n.args[2], perm)
    if name in ("index_put", "_index_put_impl") and len(n.args) >= 4 and n.args[3]:
        return len(n.args[1]) == 1 and _derived_from(n.args[1][0], perm)
    return False


def _gathers_in(n: fx.Node, perm: set) -> bool:
    """x[perm // k]: a gather of token-ordered rows by the permutation."""
    return op_name(n) == "index" and len(n.args[1]) == 1 and isinstance(n.args[1][0], fx.Node) \
        and _derived_from(n.args[1][0], perm)


def _only_offsets(n: fx.Node) -> bool:
    """Whether every use of n (through the count ops) is a grouped matmul's offsets."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        for u in m.users:
            if op_name(u) in _GROUPED and u.args[2:3] == (m,):
                continue
            if op_name(u) in _COUNTS:
                stack.append(u)
                continue
            return False
    return True


def _region(s: fx.Node, ctx: PassContext):
    """The nodes of the dispatch that `s` starts and the nodes undoing it, or None when no
    node undoes it (left to the token-independence rules, which refuse the sort)."""
    perms, sorted_vals = _perm_and_sorted(s)
    perm = set(perms)
    inverses = {u for p in perms for u in p.users if _inverse_of(u, perm)}
    region: set[fx.Node] = {s, *perms, *sorted_vals}
    undo: set[fx.Node] = set()
    leaked: list[fx.Node] = []
    stack = [*perms, *sorted_vals]
    while stack:
        m = stack.pop()
        for u in m.users:
            if u in region or u in undo:
                continue
            if _undoes(u, perm, inverses):
                undo.add(u)
                continue
            if u.op == "output":  # returned still grouped by expert: refused by `_check`
                region.add(m)
                undo.add(u)
                leaked.append(m)
                continue
            region.add(u)
            stack.append(u)
    if leaked:
        raise refuse(leaked[0], ctx.model_file,
                     f"the model returns a value of the tokens grouped by expert (node {leaked[0].name}) without "
                     "putting them back into token order", "undo the grouping after the experts")
    if not undo:
        return None
    # the static helpers of the inverse (empty_like(perm), arange(n)) belong to it
    for inv in inverses:
        region.update(a for a in inv.all_input_nodes if a not in region and a in ctx.static)
    return region, undo, perm, set(sorted_vals)


def _check(region: set, undo: set, perm: set, sorted_vals: set, ctx: PassContext) -> None:
    for n in region:
        if n.op != "call_function":
            continue
        for u in n.users:
            if u not in region and u not in undo:
                raise refuse(u, ctx.model_file,
                             f"a value of the tokens grouped by expert (node {n.name}) is used before they are put "
                             "back into token order: token slices group their own tokens, so it would differ",
                             "use the grouped rows only through the experts, then put them back (y[inverse "
                             "permutation], or index_add / scatter_add at the tokens' positions)")
        name = op_name(n)
        if name in _SORTS or n.target is operator.getitem or _gathers_in(n, perm):
            continue
        for a in n.all_input_nodes:  # rows grouped by expert joined with rows in token order
            if a not in region and a not in ctx.static and node_token_axes(a, ctx.seq_sym):
                raise refuse(n, ctx.model_file,
                             f"`{name}` (node {n.name}) joins the tokens grouped by expert with `{a.name}`, whose "
                             "rows are in token order, before the grouping is undone",
                             "gather the token-ordered value by the permutation too (x[perm // k]), or use it "
                             "after the rows are put back into token order")
        if name in _GROUPED:
            continue
        if name in _COUNTS and _only_offsets(n) and any(_derived_from(a, sorted_vals) or a in region
                                                        for a in n.all_input_nodes):
            continue
        if name in ("index_put", "_index_put_impl") and _inverse_of(n, perm):
            continue
        why = mixing_reason(n, ctx.seq_sym)
        if why is not None:
            raise refuse(n, ctx.model_file,
                         f"the mixture-of-experts dispatch mixes tokens: {why} (node {n.name}) between grouping the "
                         "tokens by expert and putting them back; only per-row ops, gathers by the permutation "
                         "and grouped matmuls over the experts' offsets keep each token's result its own",
                         "route each token on its own (top-k per token, no capacity limit) and undo the grouping "
                         "after the experts")


def recognise_expert_dispatch(ctx: PassContext) -> int:
    """Mark each recognised dispatch's nodes `KIND`; returns how many were found."""
    found = 0
    for s in list(ctx.graph.nodes):
        if s.op != "call_function" or op_name(s) not in _SORTS or s.meta.get("tpc_kind") == KIND:
            continue
        x = s.args[0]
        if not isinstance(x, fx.Node) or not node_token_axes(x, ctx.seq_sym):
            continue
        got = _region(s, ctx)
        if got is None:
            continue
        region, undo, perm, sorted_vals = got
        _check(region, undo, perm, sorted_vals, ctx)
        for n in region | undo:
            n.meta["tpc_kind"] = KIND
        found += 1
    return found


class RecogniseExpertDispatch:
    """Marks the mixture-of-experts dispatches (the module docstring); changes no value."""

    name = "expert-dispatch"

    def run(self, ctx: PassContext) -> PassContext:
        recognise_expert_dispatch(ctx)
        return ctx
