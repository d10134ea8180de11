"""The forward of a stage as `model.eval()` runs it: dropout off.

torch.export captures the model as it is (in training mode), so a dropout is a node of the
stage graph (`aten.dropout(x, p, train)`, or an attention's `dropout_p`). An evaluation runs the
same graph with every dropout made the identity: each dropout node is replaced by its input, and
every attention's `dropout_p` becomes 0. The stage's parameters are shared with the training
stage; only the graph differs. With no dropout in the model the graph is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# dropouts whose result is their input when they are off
_DROPOUTS = {aten.dropout.default, aten.alpha_dropout.default, aten.feature_dropout.default,
             aten.feature_alpha_dropout.default}
# attention ops taking dropout_p as their fifth argument
_SDPA = {aten.scaled_dot_product_attention.default}


def without_dropout(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` with every dropout the identity (see the module docstring)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _DROPOUTS:
            env[n] = env[n.args[0]] if isinstance(n.args[0], fx.Node) else n.args[0]
            continue
        new = g.node_copy(n, lambda a: env[a])
        if n.op == "call_function":
            if "dropout_p" in new.kwargs:
                new.kwargs = {**new.kwargs, "dropout_p": 0.0}
            elif n.target in _SDPA and len(new.args) > 4:
                new.args = (*new.args[:4], 0.0, *new.args[5:])
        env[n] = new
    return g
