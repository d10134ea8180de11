"""Token axes: which dimensions of each value run over the sequence.

The capture keeps every value's symbolic shape in `node.meta["val"]`; a dimension is a token axis
when its size involves the sequence symbol. This follows the axis wherever it moves
((B, T, H, D) -> transpose -> (B, H, T, D)) without a rule per op.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx


def size_expr(d):
    """A dimension size as a sympy expression (ints as sympy Integers)."""
    if isinstance(d, torch.SymInt):
        return d.node.expr
    return sympy.Integer(int(d))


def token_axes(val, seq_sym) -> tuple[int, ...]:
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(i for i, d in enumerate(val.shape) if seq_sym in size_expr(d).free_symbols)


def node_token_axes(node: fx.Node, seq_sym) -> tuple[int, ...]:
    v = node.meta.get("val")
    return token_axes(v, seq_sym) if isinstance(v, torch.Tensor) else ()


def is_seq(x, seq_sym) -> bool:
    """Is this value (a node carrying a SymInt, or a SymInt) exactly the sequence length?"""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
    return isinstance(x, torch.SymInt) and x.node.expr == seq_sym
