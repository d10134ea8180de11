"""What an ATen node of a captured graph calls: the op's name and its arguments by name. The
front end's passes read nodes through these two, so that every pass sees an op's arguments
alike (positional, keyword or left at their defaults by the trace)."""

from __future__ import annotations

import torch.fx as fx


def op_name(n: fx.Node) -> str:
    """`aten::linear.default` -> 'linear'; a Python callable by its name."""
    t = n.target
    schema = getattr(t, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def call_args(n: fx.Node) -> dict:
    """The arguments of the call `n` by their schema names: defaults first, then positional,
    then keyword arguments (a trace leaves out arguments at their defaults, unbind's dim=0). A
    target without a schema has only its keyword arguments named."""
    schema = getattr(n.target, "_schema", None)
    params = schema.arguments if schema is not None else []
    out = {a.name: a.default_value for a in params if a.has_default_value()}
    out.update(zip([a.name for a in params], n.args))
    out.update(n.kwargs)
    return out
