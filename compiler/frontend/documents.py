"""Packed documents: a stage graph made to run one row of packed documents.

A plan compiled with `documents eos ID mean M` (docs/ir.md) trains on rows that hold several
documents, each ended by the separator. Each document must be computed as if it were alone: its
positions start at 0, and its tokens attend only to its own earlier tokens. A stage graph
(`stage.py`) knows the slice only by its window [offset, offset + l); here it is given one more
input, `documents` (a `runtime_ops.DocumentSlice`, made per row and slice from the row's
document starts by `StageModule.forward`), and

* every position value the positions pass put on the slice's window (`tpc_kind` "position":
  `arange(offset, offset + l)`, a table's rows `[offset:offset + l]`, a full-length value cut to
  the window) is read at each token's position within its document instead
  (`runtime_ops.document_positions`, `document_take`): learned absolute positions, RoPE tables,
  Hugging Face's `position_ids`, all restart at each document;
* every sliced attention gets the documents, so that a query sees only its own document's keys
  (`runtime_ops.causal_attention`); a position bias (ALiBi) is read at the positions within the
  documents too.

What cannot be reset is refused here, at the model's line: a causal mixer whose state is carried
across slices (a causal convolution, a token shift) would read the last tokens of the previous
document.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpc.compiler.frontend import runtime_ops
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten

_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def refuse_unresettable(sites, model_file: str | None) -> None:
    """Refuse packed documents for a model with a causal state carried across slices (one of
    `sites` that is not an attention): its first tokens would read the previous document."""
    for site in sites:
        if site.per_slice:
            raise refuse(site.node, model_file,
                         "packed documents: this state-space scan carries its state from token to token, and at a "
                         "document's start the state is the previous document's; resetting it at document "
                         "boundaries is not built",
                         "train this model on rows of one text each (compile without --documents)")
        if site.node.target is not runtime_ops.causal_attention:
            raise refuse(site.node, model_file,
                         "packed documents: this causal mixer (a convolution or token shift over the "
                         "sequence) reads the tokens before it, which at a document's start belong to "
                         "the previous document; its state cannot be reset at a document boundary",
                         "train this model on rows of one text each (compile without --documents), or "
                         "use attention and per-token layers only")


def document_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of stage graph `graph` with a `documents` placeholder after its cached prefixes
    (before `targets`), its positions read within the documents and its attentions limited to
    them (the module docstring)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    docs = None
    for n in placeholders:
        if n.target == "targets":
            docs = g.placeholder("documents")
        env[n] = g.node_copy(n, lambda a: env[a])
    if docs is None:
        docs = g.placeholder("documents")
    for n in graph.nodes:
        if n.op == "placeholder":
            continue
        if n.meta.get("tpc_kind") == "position":
            env[n] = _position(g, n, env, docs)
            continue
        new = g.node_copy(n, lambda a: env[a])
        if new.op == "call_function" and new.target is runtime_ops.causal_attention:
            unsupported = [k for k in ("softcap", "sink", "chunk") if new.kwargs.get(k) is not None]
            if unsupported:
                raise TpirError(Diagnostic(
                    f"packed documents with an attention of {' and '.join(unsupported)} (soft-capped scores, "
                    "sinks or chunked attention) are not built", where="--documents",
                    hint="compile without --documents for this model"))
            new.kwargs = {**new.kwargs, "documents": docs}
        env[n] = new
    g.lint()
    return g


def _position(g: fx.Graph, n: fx.Node, env: dict, docs: fx.Node) -> fx.Node:
    """The position value `n` (on the slice's window) at the positions within the documents."""
    if n.target in _ARANGE:
        dtype = n.kwargs.get("dtype")
        new = g.call_function(runtime_ops.document_positions, (docs,), {"dtype": dtype} if dtype else {})
    elif n.target is aten.slice.Tensor:
        src, dim = env[n.args[0]], n.args[1] if len(n.args) > 1 else 0
        new = g.call_function(runtime_ops.document_take, (src, dim, docs))
    else:  # pragma: no cover - the positions pass makes only these two
        raise RuntimeError(f"internal: a position value made by {n.target}")
    new.meta = dict(n.meta)
    return new
