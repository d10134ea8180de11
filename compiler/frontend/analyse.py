"""Token-independence analysis: refuse every value that mixes tokens other than through a
recognised causal attention.

Runs after the attention pass, so what remains must be per-token (or static). A value mixes
tokens when an op reduces, scans or reorders along a token axis (mean over the sequence,
cumsum, softmax over keys, flip ...) or contracts a token axis (a matmul over tokens). Each
refusal names the op and the model source line. A final numeric check (in `sliced.py`) compares
sliced with unsliced outputs to catch anything these rules do not know.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpc.compiler.frontend.axes import node_token_axes
from tpc.compiler.frontend.calls import call_args, op_name
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.source_locations import refuse

_ALONG_DIM = {
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "cumsum", "cumprod", "cummax",
    "cummin", "logcumsumexp", "softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp",
    "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "prod", "any", "all", "sort",
    "topk", "flip", "roll", "median", "nansum", "count_nonzero", "kthvalue", "mode", "nanmean",
    "diff", "unbind", "narrow", "index_select", "gather", "scatter", "scatter_add", "slice", "select",
    # writes into positions along the axis (in-place writes, made functional at capture)
    "slice_scatter", "select_scatter", "diagonal_scatter", "index_copy", "index_add", "index_fill",
    "scatter_reduce",
}
# advanced indexing: the axes its index tensors select along
_INDEXED = {"index", "index_put", "_index_put_impl"}
_CONTRACT = {"matmul", "bmm", "mm", "baddbmm", "addmm", "einsum", "tensordot"}


def _dims(n: fx.Node, rank: int):
    """The dims an op works along, or None for all of them."""
    a = call_args(n)
    if "dims" in a:
        d = a["dims"]
    elif "dim" in a:
        d = a["dim"]
    else:
        return None
    if d is None:
        return None
    d = [d] if isinstance(d, int) else list(d)
    if not d:
        return None
    return {x % rank for x in d}


def _elementwise(n: fx.Node) -> bool:
    """Binary overloads such as max.other have no dim: they compare two tensors elementwise."""
    if not hasattr(n.target, "_schema"):
        return False
    names = {a.name for a in n.target._schema.arguments}
    return "other" in names and "dim" not in names


def mixing_reason(n: fx.Node, seq_sym) -> str | None:
    """Why this node mixes tokens, or None."""
    if n.op != "call_function" or n.meta.get("tpc_kind") in ("attention", "causal-window", "expert-dispatch",
                                                              "ssm-scan", "carried-out"):
        # a recognised attention; a causal window the state pass checked (carried_state.py); a
        # mixture-of-experts grouping that is undone (experts.py); a state-space scan carried
        # across slices (ssm_state.py)
        return None
    name = op_name(n)
    ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if not ins:
        return None
    x = ins[0]
    axes = node_token_axes(x, seq_sym)
    if name in _ALONG_DIM and axes and not _elementwise(n):
        dims = _dims(n, x.meta["val"].dim())
        if dims is None or dims & set(axes):
            return f"`{name}` along the sequence axis"
    if name in _INDEXED and axes:
        indices = n.args[1] if len(n.args) > 1 else n.kwargs.get("indices", ())
        if any(i in axes for i, idx in enumerate(indices or ()) if idx is not None):
            return f"`{name}` indexing along the sequence axis"
    if name in _CONTRACT and len(ins) >= 2 and axes:
        a_rank = x.meta["val"].dim()
        if (a_rank - 1) in axes:
            return f"`{name}` contracting the sequence axis"
    if name == "scaled_dot_product_attention":
        return "an attention the front end did not recognise as causal"
    if len(node_token_axes(n, seq_sym)) > 1:
        return f"`{name}` produces a (tokens x tokens) value"
    return None


class CheckTokenIndependence:
    """Refuses the first value that mixes tokens (the module docstring); changes nothing."""

    name = "token-independence"

    def run(self, ctx: PassContext) -> PassContext:
        check_token_independence(ctx)
        return ctx


def check_token_independence(ctx: PassContext) -> None:
    """Refuse the first data value of `ctx.graph` that mixes tokens (`mixing_reason`)."""
    for n in ctx.graph.nodes:
        if n in ctx.static:
            continue
        why = mixing_reason(n, ctx.seq_sym)
        if why is not None:
            raise refuse(
                n, ctx.model_file,
                f"the model mixes tokens: {why} (node {n.name}, op {n.target}); token slices would "
                "get a silently wrong gradient",
                "only per-token ops and causal attention can be sliced: reduce over the hidden "
                "axis (dim=-1) instead, or use causal attention (is_causal=True)")
