"""Cost records: FLOPs, bytes and kernels of every op of the sliced graph, as symbolic
expressions of the slice.

`annotate_costs` stores an `OpCost` in `node.meta["tpc_cost"]` for every node. Its expressions
are sympy expressions in the graph's own symbols (the capture's batch `b` and sequence `l`
symbols, which in the sliced graph are the micro-batch rows and the slice length), plus

  * `CTX` (`c`): the tokens of KV cache before the slice. The prefix placeholders carry the
    slice's own `val` (their token size is the same symbol), so the attention op is the one
    place the context enters, and it is priced with `c + l` keys explicitly;
  * `WIDTH` (`w`): bytes of one floating-point element. The graph is traced in float32, but a
    GPU device model prices a bf16/fp16 run (its peak FLOP/s is the tensor-core figure), so the
    element width is chosen when the costs are evaluated, not when they are counted.

Per op class (a "kernel" is one launch of eager PyTorch):

  * free (views, reshapes of contiguous values, `getitem`, size arithmetic, same-dtype casts,
    inactive dropout): nothing;
  * matmul (`linear`, `mm`, `addmm`, `bmm`, `matmul`, `baddbmm`): 2*m*n*k (+ m*n for a bias),
    bytes of both operands and the result, one kernel;
  * `runtime_ops.causal_pad` (a causal convolution's or shift's carried tokens joined to the slice's):
    a copy, priced as a memory op;
  * a mixture-of-experts grouped matmul (`grouped_mm`, rows grouped by expert): as `mm`, each
    of the S = tokens x top-k rows times its expert's matrix, 2*S*k*n, all experts' weights read;
  * attention (`runtime_ops.causal_attention`): Q K^T and P V over `c + l` keys,
    2*b*h*l*(c+l)*(d_qk + d_v), as one fused kernel that reads q and the full keys and values
    and writes the output (the scores stay on chip; on CUDA the bottom-right alignment is a
    causal bias, no mask is read); with a prefix, two more kernels concatenate cache and slice
    (they copy `c + l` rows), with GQA's `rep` two more repeat the heads. The full l x (c+l)
    rectangle is counted, an upper bound of what a kernel that skips masked blocks computes; a
    sliding-window layer (`window` w) reads `min(c, w - 1) + l` keys, a chunked one (`chunk` c)
    as many as a window of c (an upper bound: `c mod chunk + l` are read); a position bias (ALiBi)
    adds the bytes of the (l x keys) bias per query head, written once and read as the mask; an
    attention written out (soft-capping, a sink) writes and reads its scores and probabilities,
    (l x keys) per query head each, in four more kernels, and keeps both for its backward;
  * a state-space scan (`ssm_ops`' carried forms), with W = tokens x the state's elements
    (batch x l x channels x state for Mamba): a recurrence run token by token (Mamba's, RWKV's,
    RecurrentGemma's) is a memory op of 6W FLOPs that writes and reads W-sized operands, a few
    kernels per token, keeping 3W floats for its backward; Mamba-2's chunked form (chunk q,
    at most l), 2*b*l*q*heads*(state + head_dim) FLOPs within the chunks plus 4W for the
    states, about 30 kernels, keeping the chunks' (l x q) scores per head. Estimates of the
    reference code's work, not of a fused kernel's;
  * memory (elementwise, norms, reductions, softmax, gathers, copies, the loss): a few FLOPs
    per element (`_FLOPS_PER_ELEMENT`), bytes of every input and the output, one kernel.

Backward, derived per class: matmul 2x the FLOPs and bytes in 2 kernels (input gradient and
weight gradient), plus, when one operand is a parameter, a kernel adding the weight gradient
into `.grad` (3 passes over the weight); attention 2x in 2x the kernels (the math path's four
matmuls dQ, dK, dV, dP; a flash kernel that recomputes the scores does 2.5x); memory ops 2x the
FLOPs and bytes in the same number of kernels (the embedding's is a scatter-add into the
table's gradient); free ops nothing.

`out_bytes` is what the op leaves allocated, an estimate of what a forward keeps for its
backward (every saved tensor is some op's output).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import numpy as np
import sympy
import torch
import torch.fx as fx

from tpc.compiler.frontend import runtime_ops, ssm_ops
from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.calls import op_name
from tpc.compiler.frontend.context import PassContext

aten = torch.ops.aten

CTX = sympy.Symbol("c", integer=True, nonnegative=True)
WIDTH = sympy.Symbol("w", integer=True, positive=True)

CLASSES = ("matmul", "attention", "memory")  # the op classes that cost something


@dataclass(frozen=True)
class OpCost:
    """What one op costs for one slice (sympy expressions; see the module docstring)."""

    kind: str  # "free" or one of CLASSES
    flops: sympy.Expr
    bytes: sympy.Expr
    kernels: sympy.Expr
    bwd_flops: sympy.Expr
    bwd_bytes: sympy.Expr
    bwd_kernels: sympy.Expr
    out_bytes: sympy.Expr
    # the gradient of the output a split backward keeps from backward-input to backward-weight:
    # an op that mixes an input-dependent operand with a parameter (executors/weight_grads.py)
    held: sympy.Expr = sympy.Integer(0)


_ZERO = sympy.Integer(0)
FREE = OpCost("free", _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO)

# Views, aliases and shape bookkeeping: no kernel, no bytes.
_VIEWS = {
    "view", "_unsafe_view", "flatten", "unflatten", "transpose", "t", "permute", "expand",
    "expand_as", "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes", "chunk",
    "unbind", "alias", "view_as", "view_as_real", "view_as_complex", "detach", "narrow",
    "as_strided", "diagonal", "sym_size", "sym_numel", "sym_stride", "lift_fresh_copy",
}
# Copies that are no-ops when the input is already contiguous (the meta keeps strides).
_MAYBE_COPY = {"contiguous", "reshape"}
# Casts: free when the dtype does not change (eager PyTorch returns the input itself).
_CASTS = {"to", "type_as", "_to_copy"}
_MATMULS = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm"}
# a mixture-of-experts layer's grouped matmul (experts.py): rows grouped by expert, each row
# times its own expert's matrix, so the top-k experts of a token cost k rows; every expert's
# weights are read
_GROUPED_MATMULS = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}
# Rough arithmetic per output element of memory-bound ops (they are priced by bytes; FLOPs
# matter only in the rare op whose arithmetic outweighs its traffic). Default 1.
_FLOPS_PER_ELEMENT = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "exp": 2, "log": 2, "rsqrt": 2, "sqrt": 2,
    "pow": 2, "layer_norm": 8, "native_layer_norm": 8, "rms_norm": 6, "softmax": 5,
    "_softmax": 5, "log_softmax": 5, "_log_softmax": 5, "dropout": 2, "embedding": 0, "cat": 0,
    "repeat_interleave": 0, "index_select": 0, "gather": 0, "clone": 0, "copy": 0,
    "_to_copy": 0, "to": 0, "type_as": 0, "contiguous": 0, "reshape": 0,
}


def numel(val) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in val.shape:
        out = out * size_expr(d)
    return out


def element_bytes(val) -> sympy.Expr:
    """Bytes of one element: floating values at WIDTH (complex at twice), others as traced."""
    if val.dtype.is_complex:
        return 2 * WIDTH
    if val.dtype.is_floating_point:
        return WIDTH
    return sympy.Integer(val.dtype.itemsize)


def tensor_bytes(val) -> sympy.Expr:
    return numel(val) * element_bytes(val)


def _val(x):
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _tensor_inputs(n: fx.Node) -> list:
    seen, out = set(), []
    for a in n.all_input_nodes:
        v = _val(a)
        if v is not None and a not in seen:
            seen.add(a)
            out.append(v)
    return out


def _memory(flops, nbytes, out_bytes, kernels=1) -> OpCost:
    """A memory-bound op; its backward reads and writes twice the bytes in as many kernels."""
    k = sympy.sympify(kernels)
    return OpCost("memory", flops, nbytes, k, 2 * flops, 2 * nbytes, k, out_bytes)


def _matmul(n: fx.Node, name: str, static: set) -> OpCost:
    out = _val(n)
    args = [a for a in n.args if isinstance(a, fx.Node)]
    if name == "linear":
        k = size_expr(_val(args[0]).shape[-1])  # x (..., k) @ W (n, k)^T
        bias = len(args) > 2
        operands = args[:3]
    elif name in ("addmm", "baddbmm"):  # bias, a, b
        a = args[1]
        k = size_expr(_val(a).shape[-1])
        bias = True
        operands = args[:3]
    else:  # mm, bmm, matmul: a, b
        a = args[0]
        k = size_expr(_val(a).shape[-1])
        bias = False
        operands = args[:2]
    m_n = numel(out)
    flops = 2 * m_n * k + (m_n if bias else 0)
    nbytes = sum((tensor_bytes(_val(o)) for o in operands), _ZERO) + tensor_bytes(out)
    # A parameter operand (static: a weight or a view of one) has its gradient accumulated
    # into `.grad` after every slice's backward: read it, read the new one, write the sum.
    accum = sum((3 * tensor_bytes(_val(o)) for o in operands[:3] if o in static), _ZERO)
    n_accum = sum(1 for o in operands[:3] if o in static)
    return OpCost("matmul", flops, nbytes, sympy.Integer(1), 2 * flops, 2 * nbytes + accum,
                  sympy.Integer(2 + n_accum), tensor_bytes(out))


def _attention(n: fx.Node) -> OpCost:
    q, k, v = (_val(a) for a in n.args[:3])
    out = _val(n)
    rep = int(n.kwargs.get("rep", 1) or 1)
    lq, dq = size_expr(q.shape[-2]), size_expr(q.shape[-1])
    lk, dv = size_expr(k.shape[-2]), size_expr(v.shape[-1])
    rows = numel(q) / (lq * dq)  # batch x heads of the queries ((B, H) or BLOOM's B * H)
    window = n.kwargs.get("window") or n.kwargs.get("chunk")
    # the cached prefix and the slice's own keys; a sliding window reads its last w - 1 only
    keys = (sympy.Min(CTX, int(window) - 1) if window else CTX) + lk
    has_prefix = sympy.Min(CTX, 1)  # 0 for the first slice, 1 after (c is an integer >= 0)
    flops = 2 * rows * lq * keys * (dq + dv)
    kf = numel(k) / lk * keys * element_bytes(k)  # keys with the prefix
    vf = numel(v) / lk * keys * element_bytes(v)
    grown = rep * (kf + vf)  # what the attention kernel reads as keys and values
    nbytes = tensor_bytes(q) + grown + tensor_bytes(out)
    if n.kwargs.get("bias") is not None:  # the slice's bias, built and read as the mask
        nbytes = nbytes + 2 * rows * lq * keys * WIDTH
    # cat([prefix, slice]) reads the prefix and the slice and writes the full keys/values
    cat = has_prefix * 2 * (kf + vf)
    repeat = (kf + vf) * (1 + rep) if rep != 1 else _ZERO  # repeat_interleave over heads
    kernels = 1 + 2 * has_prefix + (2 if rep != 1 else 0)
    saved = tensor_bytes(out) + has_prefix * (kf + vf) + ((rep * (kf + vf)) if rep != 1 else _ZERO)
    if n.kwargs.get("softcap") is not None or n.kwargs.get("sink") is not None:  # written out
        scores = rows * lq * keys * WIDTH
        nbytes, kernels, saved = nbytes + 4 * scores, kernels + 4, saved + 2 * scores
    total = nbytes + cat + repeat
    return OpCost("attention", flops, total, kernels, 2 * flops, 2 * total, 2 * kernels, saved)


def _generic(n: fx.Node, name: str) -> OpCost:
    out = _val(n)
    if out is None:  # a tuple result (e.g. native_layer_norm's (y, mean, rstd)): all written,
        vals = n.meta.get("val")
        outs = [x for x in vals if isinstance(x, torch.Tensor)] if isinstance(vals, (tuple, list)) else []
        if not outs:
            return FREE
        written = sum((tensor_bytes(x) for x in outs), _ZERO)
        out = outs[0]  # the main result sets the per-element arithmetic
    else:
        written = tensor_bytes(out)
    per = _FLOPS_PER_ELEMENT.get(name, 1)
    if out.dtype.is_complex:
        per = 6 if name == "mul" else 2 * per  # a complex product is 4 multiplies + 2 adds
    ins = _tensor_inputs(n)
    read = sum((tensor_bytes(x) for x in ins), _ZERO)
    if name in ("mean", "sum", "amax", "amin", "var", "std", "norm", "linalg_vector_norm"):
        flops = sum((numel(x) for x in ins), _ZERO)  # one operation per element reduced
    else:
        flops = per * numel(out)
    return _memory(flops, read + written, written)


def _scan(n: fx.Node) -> OpCost:
    """A carried state-space scan (the module docstring)."""
    y, state = n.meta["val"]
    tokens = size_expr(y.shape[-1] if n.target is ssm_ops.selective_scan_carried else y.shape[1])
    work = tokens * numel(state)  # tokens x the state's elements (state: (batch, 1, ...))
    io = sum((tensor_bytes(v) for v in _tensor_inputs(n)), _ZERO) + tensor_bytes(y) + tensor_bytes(state)
    if n.target is not ssm_ops.ssd_scan_carried:  # the reference loop over the slice's tokens
        flops, nbytes = 6 * work, io + 4 * work * WIDTH
        kernels, saved = 3 * tokens + 8, 3 * work * WIDTH
    else:
        b, _, heads, head_dim = (size_expr(d) for d in y.shape)
        chunk = sympy.Min(int(n.args[10]), tokens)
        scores = b * tokens * chunk * heads
        flops = 2 * scores * (size_expr(state.shape[-1]) + head_dim) + 4 * work
        nbytes, kernels, saved = io + 4 * scores * WIDTH, sympy.Integer(30), 2 * scores * WIDTH + tensor_bytes(state)
    return OpCost("memory", flops, nbytes, sympy.sympify(kernels), 2 * flops, 2 * nbytes, 2 * sympy.sympify(kernels),
                  saved)


def op_cost(n: fx.Node, static: set) -> OpCost:
    """The cost record of one node (see the module docstring)."""
    if n.op != "call_function":
        return FREE
    if n.target is runtime_ops.causal_attention:
        return _attention(n)
    if n.target is runtime_ops.sum_token_loss:
        return loss_cost(_val(n.args[0]))
    if n.target is runtime_ops.causal_pad:  # the carried tokens, the slice's and the padding, joined
        written = tensor_bytes(_val(n))
        return _memory(_ZERO, 2 * written, written)
    if n.meta.get("tpc_kind") == "ssm-scan" and n.target is not operator.getitem:
        return _scan(n)
    if n.target is operator.getitem or not hasattr(n.target, "_schema"):
        return FREE  # tuple access, SymInt arithmetic
    out = n.meta.get("val")
    if not isinstance(out, (torch.Tensor, tuple, list)):
        return FREE  # a size, a scalar
    name = op_name(n)
    if name in _VIEWS:
        return FREE
    ins = [_val(a) for a in n.args if _val(a) is not None]
    if name in _MAYBE_COPY and ins and ins[0].is_contiguous():
        return FREE
    if name in _CASTS and ins and isinstance(out, torch.Tensor) and ins[0].dtype == out.dtype:
        return FREE
    if name == "dropout" and not (n.args[1] and n.args[2]):
        return FREE  # p == 0 or not training: eager returns the input
    if name in _MATMULS:
        return _matmul(n, name, static)
    if name in _GROUPED_MATMULS:  # x (S, k) rows, each times its expert's (k, n): 2*S*k*n, as mm
        return _matmul(n, "mm", static)
    if name == "embedding":  # gather rows: read the ids and the rows, write them
        ids = _val(n.args[1])
        rows = tensor_bytes(out)
        return _memory(_ZERO, tensor_bytes(ids) + 2 * rows, rows)
    return _generic(n, name)


def loss_cost(logits) -> OpCost:
    """`runtime_ops.sum_token_loss`: the cast of the logits to float32 (when they are narrower), log-softmax
    over the vocabulary, and the summed negative log-likelihood of the targets."""
    n = numel(logits)
    tokens = n / size_expr(logits.shape[-1])
    cast_kernel = sympy.Piecewise((0, sympy.Eq(WIDTH, 4)), (1, True))
    cast = cast_kernel * n * (WIDTH + 4)
    log_softmax = 2 * n * 4
    nll = tokens * (4 + 8)  # read one log-probability and one int64 target per token
    return _memory(5 * n, cast + log_softmax + nll, n * 4, kernels=2 + cast_kernel)


# norms whose backward gives the input's and the parameters' gradients in one kernel
_FUSED_NORMS = {torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default,
                torch.ops.aten.layer_norm.default, torch.ops.aten.group_norm.default}


def _held(n: fx.Node, cost: OpCost, static: set, weighted: set) -> OpCost:
    """`cost` with what a split backward keeps of this op until its weight half, where the op
    joins a parameter (or a value computed from one) with an activation (the stage's
    backward_input and backward_weight programs, compiler/programs/joint.py: every op of the
    backward runs in the half that first needs it). A matmul (a linear layer), or a bias or a
    scale added or multiplied in, keeps the gradient of its output: its parameter's gradient
    (`dW = dY^T X`, a sum of dY, of dY * X) is only the weight half's work. A norm whose
    backward is one kernel for the input and the parameters (`native_layer_norm`) computes its
    parameters' gradients in the input half, and that is what is kept: the size of the
    weighted operands. A stage with no input (the first) defers its whole backward, keeping
    only its output gradient there; the count per op is above that."""
    if cost.kind == "free":
        return cost
    operands = [a for a in n.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    if not (any(a in weighted for a in operands) and any(a not in static for a in operands)):
        return cost
    if cost.kind == "matmul" or n.target not in _FUSED_NORMS:
        out = _val(n)
        if out is None:  # a tuple result (a carried scan's (y, state)): its main result's gradient
            out = n.meta["val"][0]
        return dataclasses.replace(cost, held=tensor_bytes(out))
    return dataclasses.replace(cost, held=sum(tensor_bytes(_val(a)) for a in dict.fromkeys(operands) if a in weighted))


def weighted_nodes(graph: fx.Graph, static: set, params: set[str]) -> set:
    """The static nodes computed from a parameter (`params`: the names of the parameters)."""
    out: set = set()
    for n in graph.nodes:
        if n.op == "get_attr" and n.target in params:
            out.add(n)
        elif n in static and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def annotate_costs(graph: fx.Graph, static: set, weighted: set = frozenset()) -> None:
    """Store `OpCost` records in `node.meta["tpc_cost"]` for every node of `graph`; `static` are
    the nodes computed from parameters, buffers and sizes only (a matmul with a static operand
    accumulates a weight gradient)."""
    for n in graph.nodes:
        n.meta["tpc_cost"] = _held(n, op_cost(n, static), static, weighted)


class AnnotateCosts:
    """Every node of the rewritten graph gets its cost record, `node.meta["tpc_cost"]` (stage
    graphs copy the records with their nodes)."""

    name = "costs"

    def run(self, ctx: PassContext) -> PassContext:
        annotate_costs(ctx.graph, ctx.static, weighted_nodes(ctx.graph, ctx.static, ctx.param_names))
        return ctx


# ------------------------------------------------------------------------ per-unit sums


@dataclass(frozen=True)
class Work:
    """FLOPs, bytes and kernel launches of one op class in one direction (numpy arrays)."""

    flops: object
    bytes: object
    kernels: object


@dataclass(frozen=True)
class UnitCost:
    """A partition unit's work for slices (l, c, b), per op class, forward and backward;
    `stash` is the bytes its forward leaves for the backward."""

    label: str
    fwd: dict  # class -> Work
    bwd: dict
    stash: object
    held: object = 0.0  # bytes a split backward keeps from its input half to its weight half

    def total(self, direction: str = "fwd") -> Work:
        parts = (self.fwd if direction == "fwd" else self.bwd).values()
        return Work(sum(w.flops for w in parts), sum(w.bytes for w in parts), sum(w.kernels for w in parts))


_FIELDS = ("flops", "bytes", "kernels", "bwd_flops", "bwd_bytes", "bwd_kernels")


def sum_costs(records) -> dict:
    """{(class, field): expression} summed over cost records, ("stash", "out_bytes") and
    ("held", "out_bytes")."""
    sums = {(k, f): _ZERO for k in CLASSES for f in _FIELDS}
    sums[("stash", "out_bytes")] = _ZERO
    sums[("held", "out_bytes")] = _ZERO
    for r in records:
        if r.kind == "free":
            continue
        for f in _FIELDS:
            sums[(r.kind, f)] += getattr(r, f)
        sums[("stash", "out_bytes")] += r.out_bytes
        sums[("held", "out_bytes")] += r.held
    return sums


class UnitCostFn:
    """`fn(l, c, b) -> UnitCost`: a unit's summed cost records, lambdified for numpy.

    The expressions are kept (`exprs`, in the symbols `l`, `c`, `b`) so tests and documents can
    read them; evaluation takes arrays (broadcast together), as the optimiser asks about many
    (l, c, b) points at once."""

    def __init__(self, label: str, sums: dict, seq_sym, batch_sym, float_bytes: int):
        self.label = label
        l, b = sympy.Symbol("l", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
        rename = {seq_sym: l, batch_sym: b, WIDTH: float_bytes}
        self.keys = list(sums)
        self.exprs = {k: sympy.expand(sympy.sympify(e).subs(rename)) for k, e in sums.items()}
        self.symbols = (l, CTX, b)
        self._fn = sympy.lambdify(self.symbols, [self.exprs[k] for k in self.keys], "numpy")
        # identical units (the blocks of one model) price the same: a key to tell them apart
        self.signature = tuple(sympy.srepr(self.exprs[k]) for k in self.keys)

    def values(self, l, c, b) -> dict:
        l, c, b = (np.asarray(x, dtype=np.float64) for x in (l, c, b))
        shape = np.broadcast(l, c, b).shape
        out = self._fn(l, c, b)
        return {k: np.broadcast_to(np.asarray(v, dtype=np.float64), shape) for k, v in zip(self.keys, out)}

    def __call__(self, l, c, b) -> UnitCost:
        v = self.values(l, c, b)
        fwd = {k: Work(v[(k, "flops")], v[(k, "bytes")], v[(k, "kernels")]) for k in CLASSES}
        bwd = {k: Work(v[(k, "bwd_flops")], v[(k, "bwd_bytes")], v[(k, "bwd_kernels")]) for k in CLASSES}
        return UnitCost(self.label, fwd, bwd, v[("stash", "out_bytes")], v[("held", "out_bytes")])

    def relabel(self, label: str) -> "UnitCostFn":
        """The same function under another unit's label (identical blocks share the lambdified
        code)."""
        twin = object.__new__(UnitCostFn)
        twin.__dict__.update(self.__dict__)
        twin.label = label
        return twin
