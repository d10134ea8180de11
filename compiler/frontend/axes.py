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


def is_residual_stream(node: fx.Node, batch_sym, seq_sym) -> bool:
    """Has this value the residual stream's shape: floating (batch, sequence, C), C a number?"""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or not v.is_floating_point():
        return False
    b, t, c = (size_expr(d) for d in v.shape)
    return b == batch_sym and t == seq_sym and c.is_Integer
