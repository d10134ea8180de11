"""Drop the no-ops a traced library leaves around attention, so the passes see the values
themselves.

* `x[:, :]`-style slices that keep a whole axis (`slice(x, d, 0, INT64_MAX)`): the value is `x`.
* `cat([empty, x], d)`, where the other operands hold no element: the value is `x`. A key/value
  cache inside the trace (Hugging Face's `DynamicCache` with `use_cache` on) starts from an empty
  constant and appends the layer's keys to it; the attention then reads the concatenation. With
  the no-op gone, the keys the attention pass finds are the layer's own, which it caches itself.

Both replacements give the same numbers and the same gradients (a view or a copy of `x` is
replaced by `x`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.data_independent import prune_dead

aten = torch.ops.aten
_INT64_MAX = 2**63 - 1


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_empty(n) -> bool:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        return False
    sizes = [size_expr(d) for d in v.shape]
    return any(s.is_Integer and int(s) == 0 for s in sizes)


def _whole_slice(n: fx.Node) -> fx.Node | None:
    """The input of a slice that keeps its whole axis."""
    a = list(n.args) + [None] * (5 - len(n.args))
    src, dim, start, end, step = a[:5]
    start = n.kwargs.get("start", start)
    end = n.kwargs.get("end", end)
    step = n.kwargs.get("step", step)
    if start not in (None, 0) or step not in (None, 1):
        return None
    v = _val(src)
    if not isinstance(v, torch.Tensor):
        return None
    if end is None or (isinstance(end, int) and end >= _INT64_MAX):
        return src
    size = size_expr(v.shape[dim if dim is not None else 0])
    if isinstance(end, int) and size.is_Integer and end >= int(size):
        return src
    end_val = _val(end)
    if isinstance(end_val, torch.SymInt) and end_val.node.expr == size:  # x[:, :T] of T tokens
        return src
    return None


def _only_nonempty(n: fx.Node) -> fx.Node | None:
    parts = n.args[0]
    if not isinstance(parts, (list, tuple)):
        return None
    full = [p for p in parts if not _is_empty(p)]
    if len(full) != 1 or not isinstance(full[0], fx.Node):
        return None
    same = _val(full[0])
    out = _val(n)
    if not (isinstance(same, torch.Tensor) and isinstance(out, torch.Tensor)) or same.shape != out.shape \
            or same.dtype != out.dtype:
        return None
    return full[0]


def drop_noops(graph: fx.Graph) -> None:
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        keep = None
        if n.target is aten.slice.Tensor:
            keep = _whole_slice(n)
        elif n.target is aten.cat.default:
            keep = _only_nonempty(n)
        if keep is not None:
            n.replace_all_uses_with(keep)
    prune_dead(graph)
    graph.lint()
