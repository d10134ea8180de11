"""In-place writes become values, so every pass can read the graph as a data-flow graph.

The capture records what the model's Python code did, in-place writes included. A tensor built
by writing into it (the original Transformer's sinusoidal table, computed per call:

    pe = torch.zeros(T, D)
    pe[:, 0::2] = torch.sin(pos * div)    # slice(pe, 1, 0, max, 2), then copy_(that slice, sin)
    pe[:, 1::2] = torch.cos(pos * div)
    x = x + pe                            # reads `zeros`: the node the writes went into

) is, in the graph, a `zeros` node that later nodes read, and writes into views of it that no
node reads: their effect is invisible to data flow (and pruning the unused writes would lose
them). Here each write into a tensor the forward made becomes the value it produces:
`copy_(slice(pe, ...), src)` becomes `pe2 = slice_scatter(pe, copy(slice(pe, ...), src), ...)`
(`select_scatter`, ... for other views; `index_put_` becomes `index_put`, `add_` `add`, ...),
and every later reader of `pe`, or of a view of `pe`, reads `pe2` (a view re-taken from it).
The numbers are those of the write, and gradients flow through the functional ops as through
the in-place ones.

Only tensors the forward itself creates are rewritten: a write into a parameter, a buffer or the
input is a side effect that outlives the call, left as it is when the forward does not read it
back (a step counter) and refused when it does. A write through a view that has no scatter
(`as_strided`, an `expand`) is refused at the line that writes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten

# view op -> how a value written into the view goes back into its base
_SCATTER = {
    aten.slice.Tensor: lambda base, src, a: (aten.slice_scatter.default, (base, src, *a[1:])),
    aten.select.int: lambda base, src, a: (aten.select_scatter.default, (base, src, *a[1:])),
    aten.diagonal.default: lambda base, src, a: (aten.diagonal_scatter.default, (base, src, *a[1:])),
    aten.transpose.int: lambda base, src, a: (aten.transpose.int, (src, *a[1:])),
    aten.unsqueeze.default: lambda base, src, a: (aten.squeeze.dim, (src, a[1])),
    aten.squeeze.dim: lambda base, src, a: (aten.unsqueeze.default, (src, a[1])),
    aten.narrow.default: lambda base, src, a: (aten.slice_scatter.default, (base, src, a[1], a[2], a[2] + a[3])),
    aten.alias.default: lambda base, src, a: (aten.alias.default, (src,)),
}
# views a write cannot be carried back through (refused); casts, `contiguous` and `reshape`,
# which return their input only sometimes, are not followed: a write into them is a write into a
# tensor of their own
_NO_SCATTER = {aten.view.default, aten.expand.default, aten.as_strided.default, aten.unfold.default,
               aten.t.default, aten.permute.default, aten.squeeze.default, aten.view_as_real.default,
               aten.view_as_complex.default, aten.unflatten.int}


def _is_view(n: fx.Node) -> bool:
    """An op whose result is a view of its first argument (slice, select, transpose ...)."""
    return n.op == "call_function" and (n.target in _SCATTER or n.target in _NO_SCATTER)


def _functional(n: fx.Node):
    """The functional overload of an in-place op on its first argument (`copy_` -> `copy`), or
    None when `n` is not one."""
    t = n.target
    schema = getattr(t, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.arguments:
        return None
    alias = schema.arguments[0].alias_info
    name = schema.name.split("::")[-1]
    if alias is None or not alias.is_write or not name.endswith("_") or any(a.is_out for a in schema.arguments):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, t._overloadname, None) if packet is not None else None


def _chain(x: fx.Node) -> list[fx.Node]:
    """[base, view, view of it, ..., x]: x followed back through views to the tensor they alias."""
    out = [x]
    while _is_view(out[-1]) and isinstance(out[-1].args[0], fx.Node):
        out.append(out[-1].args[0])
    return out[::-1]


def functionalize(graph: fx.Graph, model_file: str | None = None) -> None:
    """Rewrite every in-place write into a tensor the forward creates as the value it makes."""
    sub: dict[fx.Node, fx.Node] = {}  # a stale tensor or view -> a node holding a newer value

    def current(a: fx.Node) -> fx.Node:
        while a in sub:
            a = sub[a]
        return a

    writes = []
    for n in list(graph.nodes):
        if sub:
            n.args = fx.node.map_arg(n.args, current)
            n.kwargs = fx.node.map_arg(n.kwargs, current)
        pure = _functional(n)
        if pure is None or not isinstance(n.args[0], fx.Node):
            continue
        chain = _chain(n.args[0])
        base = chain[0]
        if base.op != "call_function":  # a parameter, buffer or the input: a lasting side effect
            _check_unread(graph, n, base, model_file)
            continue
        for v in chain[1:]:
            if v.target not in _SCATTER:
                name = getattr(v.target, "__name__", str(v.target))
                raise refuse(n, model_file, f"an in-place write into a view made by `{name}` (node {v.name})",
                             "write into the tensor through slices or indexing (t[:, 0::2] = ..., t[idx] = ...), "
                             "or build the value without in-place writes (torch.cat, torch.stack, torch.where)")
        _rewrite(graph, n, pure, chain, sub)
        writes.append(n)
    for n in writes:
        graph.erase_node(n)


def _check_unread(graph: fx.Graph, n: fx.Node, base: fx.Node, model_file) -> None:
    """A write into a parameter, buffer or the input is left alone when nothing in the forward
    reads it afterwards (a step counter); one the forward reads back is refused: its value
    would depend on the calls before, which token slices do not repeat."""
    order = {m: i for i, m in enumerate(graph.nodes)}
    readers = [u for v in [base, *_views_of(base, order)] for u in v.users
               if order[u] > order[n] and not _is_view(u) and not (_functional(u) and u.args[0] is v)]
    if readers:
        what = f"the {'input' if base.op == 'placeholder' else 'parameter or buffer'} `{base.target}`"
        raise refuse(n, model_file, f"an in-place write into {what}, which the forward reads afterwards "
                                    f"(node {readers[0].name})",
                     "compute the value into a new tensor (torch.zeros(...), then write into that) instead "
                     "of a parameter or buffer, which keeps its value from one call to the next")


def _rewrite(graph: fx.Graph, n: fx.Node, pure, chain: list[fx.Node], sub: dict) -> None:
    base = chain[0]
    cursor = n

    def add(target, args, like: fx.Node) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            new = graph.call_function(target, args)
        new.meta = {k: v for k, v in n.meta.items() if k != "val"}
        new.meta["val"] = like.meta.get("val")
        cursor = new
        return new

    if pure is aten.copy.default:  # `copy` has no derivative: the source, as the view holds it
        value = _copied(graph, n, chain[-1], n.args[1], add)
    else:
        value = add(pure, (chain[-1], *n.args[1:]), chain[-1])  # what the view holds after the write
        if n.kwargs:
            value.kwargs = dict(n.kwargs)
    for parent, view in zip(reversed(chain[:-1]), reversed(chain[1:])):
        target, args = _SCATTER[view.target](parent, value, view.args)
        value = add(target, args, parent)
    sub[base] = value
    # every view of the base read after the write is re-taken from the new value
    order = {m: i for i, m in enumerate(graph.nodes)}
    views = [u for u in _views_of(base, order) if order[u] < order[n]]
    fresh = {base: value}
    for v in views:  # graph order: a view's parent comes first
        with graph.inserting_after(cursor):
            copy = graph.node_copy(v, lambda a: fresh.get(a, a))
        copy.meta = dict(v.meta)
        cursor = fresh[v] = sub[v] = copy
    sub[n] = fresh.get(chain[-1], value)


def _copied(graph: fx.Graph, n: fx.Node, dst: fx.Node, src, add) -> fx.Node:
    """What `dst.copy_(src)` leaves in `dst`, made of ops autograd can differentiate (functional
    `copy` has no derivative: a plan holding it would stop at its first backward): `src` cast
    to `dst`'s dtype (`_to_copy`), broadcast to its shape (`expand`, sizes read from `dst`),
    and a copy of its own (`clone`), so a later write into `dst` does not reach `src`."""
    want = dst.meta.get("val")
    have = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(src, fx.Node) or want is None or have is None:
        return add(aten.copy.default, (dst, src), dst)  # not seen in a capture: values are nodes
    value = src
    if have.dtype != want.dtype:
        value = add(aten._to_copy.default, (value,), src)
        value.kwargs = {"dtype": want.dtype}
        value.meta["val"] = _like(have, want.dtype, have.shape)
    if tuple(have.shape) != tuple(want.shape):
        sizes = []
        for d, size in enumerate(want.shape):
            if isinstance(size, int):
                sizes.append(size)
            else:  # a symbolic size: read from `dst` when the graph runs
                sizes.append(add(aten.sym_size.int, (dst, d), dst))
                sizes[-1].meta["val"] = size
        value = add(aten.expand.default, (value, sizes), dst)
    return add(aten.clone.default, (value,), dst)


def _like(v: torch.Tensor, dtype, shape) -> torch.Tensor:
    """A fake value like `v` (same fake mode) of another dtype and shape."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([v])
    if mode is None:
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    with mode, mode.shape_env.suppress_guards():
        return v.new_empty(tuple(shape), dtype=dtype)


def _views_of(base: fx.Node, order: dict) -> list[fx.Node]:
    """Every view of `base` (views of views included), in graph order."""
    found, stack = [], [base]
    while stack:
        x = stack.pop()
        for u in x.users:
            if _is_view(u) and u.args[0] is x and u not in found:
                found.append(u)
                stack.append(u)
    return sorted(found, key=order.__getitem__)
