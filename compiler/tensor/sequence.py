"""Sequence parallelism: a tensor rank's stage graph with its residual stream split along the tokens.

Megatron's sequence parallelism keeps each rank's 1/T of the tokens between its tensor-parallel
regions, where every rank would otherwise hold and compute the same whole values (the residual
stream, norms, dropout, the stage's output). `sequence_parallel(graph, degree, seq, first)`
rewrites the graph one tensor rank runs (`shard.shard_graph`'s) so. Each value is either whole
(as before) or **token-split** (the rank's contiguous part of the slice's tokens along one
dimension, recorded as a negative index, which broadcasting keeps):

- the stage's input activation (not the first stage's token ids) arrives token-split: a message
  between stages carries the rank's tokens only;
- the sum after a row-parallel matmul (g) becomes a reduce-scatter along the tokens where its
  result has a token dimension of its own (forward reduce-scatter, backward all-gather); the
  vocabulary-parallel embedding's sum is split after it (`split_to_tokens`);
- ops that work token by token (pointwise ops, casts, dropout, norms and reductions over other
  dimensions) keep a token-split operand token-split; another operand held whole is cut to the
  rank's tokens where it runs along them (a learned position table), or read through f where it
  does not (a norm's weight, a bias: each rank's gradient of it covers its tokens only);
- f before a column-parallel region becomes an all-gather along the tokens (backward
  reduce-scatter);
- any other op that reads a token-split value reads it gathered (`gather_from_region`: backward,
  the rank's part of a gradient every rank holds whole), e.g. a view that flattens the tokens
  into rows (GPT-2's Conv1D);
- `sym_size` of a token-split value's token dimension is multiplied by T: the graph's sizes keep
  meaning the slice's length;
- the stage's output activation leaves token-split (cut to the rank's tokens if it is whole).

The rank's KV caches are computed inside the attention regions, from gathered values, so they
hold every token of the rank's heads, as without sequence parallelism.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.calls import call_args, op_name
from tpc.compiler.tensor import collectives

aten = torch.ops.aten

_SAME_LAYOUT = {"to", "type_as", "_to_copy", "contiguous", "clone", "alias", "detach", "dropout",
                "lift_fresh_copy"}
_NORMS = {"layer_norm", "rms_norm"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "prod", "norm", "linalg_vector_norm"}


def sequence_parallel(graph: fx.Graph, degree: int, seq, first: bool, group_attr: str) -> fx.Graph:
    """The graph of a tensor rank (`shard.shard_graph`'s) with sequence parallelism (the module
    docstring). `seq`: the slice-length symbol of the captured shapes; `first`: the stage reads
    token ids (whole) rather than an activation."""
    return _Rewrite(graph, degree, seq, first, group_attr).run()


class _Rewrite:
    def __init__(self, graph, degree, seq, first, group_attr):
        self.src, self.T, self.seq, self.first, self.group_attr = graph, degree, seq, first, group_attr
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.tok: dict[fx.Node, int] = {}  # new node -> its token dimension (negative)
        self.nd: dict[fx.Node, int] = {}  # new node -> its number of dimensions, where no meta says
        self.group: fx.Node | None = None

    # ---------------------------------------------------------------- helpers

    def token_dim(self, n: fx.Node) -> int | None:
        """The dimension of `n`'s captured value that runs along the slice's tokens (negative),
        or None."""
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        dims = [i for i, d in enumerate(val.shape) if size_expr(d) == self.seq]
        return dims[0] - val.dim() if len(dims) == 1 else None

    def ndim(self, n: fx.Node) -> int | None:
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        return val.dim() if isinstance(val, torch.Tensor) else None

    def call(self, fn, *args) -> fx.Node:
        return self.g.call_function(fn, args)

    @property
    def grp(self) -> fx.Node:
        """The tensor group's node (made here when the rank's graph had no collective yet)."""
        if self.group is None:
            self.group = self.g.get_attr(self.group_attr)
        return self.group

    def gathered(self, new: fx.Node) -> fx.Node:
        """A token-split value gathered whole (backward: the rank's part of the gradient)."""
        return self.call(collectives.gather_from_region, new, self.tok[new], self.grp)

    # ---------------------------------------------------------------- the walk

    def run(self) -> fx.Graph:
        placeholders = [n for n in self.src.nodes if n.op == "placeholder"]
        for n in self.src.nodes:
            if n.op == "placeholder":
                new = self.g.node_copy(n, lambda m: self.env[m])
                if n is placeholders[0] and not self.first:
                    # a message is (rows, tokens, hidden) (ir/semantics.py, message_shape)
                    self.tok[new], self.nd[new] = -2, 3
            elif n.op == "get_attr":
                new = self.g.node_copy(n, lambda m: self.env[m])
                if n.target == self.group_attr:
                    self.group = new
            elif n.op == "output":
                new = self.output(n)
            else:
                new = self.visit(n)
            new.meta = dict(n.meta)
            self.env[n] = new
        self.g.lint()
        return self.g

    def output(self, n: fx.Node) -> fx.Node:
        outs = n.args[0]
        y, *rest = outs if isinstance(outs, (tuple, list)) else (outs,)
        ny = self.env[y]
        if ny not in self.tok and self.token_dim(y) is not None:  # the activation leaves token-split
            ny = self.call(collectives.split_to_tokens, ny, self.token_dim(y), self.grp)
        others = [self.gathered(self.env[r]) if self.env[r] in self.tok else self.env[r] for r in rest]
        return self.g.output((ny, *others) if isinstance(outs, (tuple, list)) else ny)

    def visit(self, n: fx.Node) -> fx.Node:
        split_in = [a for a in n.all_input_nodes if self.env[a] in self.tok]
        if n.target is aten.sym_size.int:
            new = self.g.node_copy(n, lambda m: self.env[m])
            src = self.env[n.args[0]]
            nd = self.ndim(n.args[0]) or self.nd.get(src)
            if src in self.tok and nd is not None and n.args[1] % nd == self.tok[src] % nd:
                return self.call(operator.mul, new, self.T)  # the slice's length, not the rank's part
            return new
        if n.target is collectives.copy_to_region and split_in:  # f: gather into the region
            x = self.env[n.args[0]]
            return self.call(collectives.all_gather, x, self.tok[x], self.grp)
        if not split_in:
            new = self.g.node_copy(n, lambda m: self.env[m])
            d = self.token_dim(n)
            if d is not None and n.target is collectives.reduce_from_region:  # g: scatter the sum
                new.target = collectives.reduce_scatter
                new.args = (new.args[0], d, new.args[1])
                self.tok[new] = d
            elif d is not None and n.target is collectives.vocab_parallel_embedding:
                new.meta = dict(n.meta)
                new = self.call(collectives.split_to_tokens, new, d, self.grp)
                self.tok[new] = d
            return new
        d = self.token_local(n, split_in)
        if d is None:  # read whole: gather the token-split operands
            gathered = {a: self.gathered(self.env[a]) for a in split_in}
            return self.g.node_copy(n, lambda m: gathered.get(m, self.env[m]))
        like = self.env[split_in[0]]

        def operand(m):
            new = self.env[m]
            if new in self.tok:
                return new
            if not _is_tensor(m):
                return new
            return self.call(collectives.token_operand, new, like, d, self.grp)

        new = self.g.node_copy(n, operand)
        self.tok[new] = d
        return new

    def token_local(self, n: fx.Node, split_in: list[fx.Node]) -> int | None:
        """The token dimension of `n`'s result (negative) when `n` works token by token on its
        token-split operands, else None."""
        dims = {self.tok[self.env[a]] for a in split_in}
        if len(dims) != 1:
            return None
        d = dims.pop()
        name = op_name(n)
        pointwise = isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags
        if pointwise or name in _SAME_LAYOUT:
            if name == "dropout" and (call_args(n).get("p") or 0) > 0 and call_args(n).get("train", True):
                return None  # each rank's tokens would need their own mask stream
            return d
        nd = (self.ndim(n.args[0]) or self.nd.get(self.env[n.args[0]])) if n.args and isinstance(n.args[0], fx.Node) \
            else None
        if nd is None:
            return None
        if name in _NORMS:
            shape = call_args(n).get("normalized_shape")
            k = len(shape) if isinstance(shape, (list, tuple)) else 1
            return d if -d > k and n.args[0] in split_in else None
        if name in _REDUCTIONS and n.args[0] in split_in:
            a = call_args(n)
            dims_ = a.get("dim")
            if dims_ is None:
                return None
            dims_ = [x % nd for x in (dims_ if isinstance(dims_, (list, tuple)) else [dims_])]
            if (d % nd) in dims_:
                return None
            if a.get("keepdim", False):
                return d
            after = sum(1 for x in dims_ if x > d % nd)  # reduced dimensions to the token's right
            return d + after
        return None


def _is_tensor(n) -> bool:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(val, torch.Tensor) or (isinstance(n, fx.Node) and n.op == "get_attr")
