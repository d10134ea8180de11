"""Split backward without doing the backward twice: input gradients now, weight gradients later.

`backward-input` must return the gradients of a slice's input and cached prefix quickly (the
previous stage and the earlier slices wait for them); `backward-weight` adds the parameter
gradients later. Running autograd once for the inputs and once more from the outputs for the
parameters walks the graph twice: every activation gradient is computed again, and the two
halves cost about 1.7x one backward.

Instead the graph is cut in two. "Dependent" nodes are those whose output depends on an input
(the stage input or the prefix leaves); the input half runs exactly those. A parameter's
gradient leaves them along the edges from a dependent node (an "intermediate", e.g. a linear
layer's `AddmmBackward`) to an independent one (its `TBackward` to the weight, or its bias's
accumulator): the "frontier". Everything below the frontier is independent of the inputs, so
it is the weight half's alone.

- The input half runs autograd for the inputs, with hooks keeping the gradients each
  intermediate receives.
- The weight half first runs each intermediate once more, from its kept gradients and asked
  only for its own frontier edges (`dW = Xᵀ dY` for a linear layer; nothing above or beside it
  runs again: the other intermediates are muted). A linear layer's `AddmmBackward0` is computed
  here directly (`_linear_weight_grads`): one autograd call per intermediate walks the graph
  below it, which on small layers costs more than the GEMM itself. Then one autograd call from the frontier
  edges, plus the outputs that do not depend on an input (a first stage's keys/values, into
  which later slices send gradients), down to the parameters.

Every gradient reaches a parameter once: along one frontier edge, or from an independent output.
The decomposition of `torch.distributed.pipelining`'s stage_backward_input/_weight, but cut at
single edges, so a parameter used in two places (tied embeddings) does not drag the activation
gradients between its uses into the weight half.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node


def storage_key(t: torch.Tensor) -> tuple:
    """What tells one tensor's storage from another's (views of one storage share it)."""
    st = t.untyped_storage()
    return st.device.type, st.data_ptr()


def _node(t: torch.Tensor) -> Node:
    """The autograd node gradients of `t` flow into: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad


def _users(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below `roots`: node -> the nodes that use its output."""
    users: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, todo = set(roots), collections.deque(roots)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return users


def _upward(starts, users) -> set:
    """`starts` and every node that uses their outputs, transitively."""
    seen, todo = set(starts), collections.deque(starts)
    while todo:
        for user in users.get(todo.popleft(), ()):
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _add(into: dict, key, grad) -> None:
    if grad is not None:
        into[key] = grad if key not in into else into[key] + grad


@dataclass
class DeferredWeightGrads:
    """What the weight half needs (see the module docstring)."""

    frontier: dict  # intermediate -> [(index in next_functions, child node, input nr)]
    kept: dict  # intermediate -> the gradients it received in the input half
    independent: dict  # (output node, nr) -> upstream gradient, outputs not depending on inputs
    params: dict  # accumulator node -> parameter
    # intermediates with a frontier child that another node feeds too (a parameter used twice):
    # only their runs need the other intermediates muted (see `apply`)
    shared: frozenset = frozenset()

    def held_bytes(self) -> int:
        """Bytes of the gradients kept for the weight half (each storage once): what a split
        backward holds between its halves beyond the forward's stash."""
        grads = [g for gs in self.kept.values() for g in gs] + list(self.independent.values())
        seen = {storage_key(g): g.untyped_storage().nbytes() for g in grads if g is not None}
        return int(sum(seen.values()))

    def apply(self) -> None:
        """Add the slice's parameter gradients into `.grad`; the state is dropped."""
        below: dict = dict(self.independent)  # (node, nr) -> gradient entering it
        others = list(self.frontier)
        for node, edges in self.frontier.items():
            grads = self.kept.get(node)
            if grads is None or all(g is None for g in grads):
                continue
            direct = _linear_weight_grads(node, grads, edges)
            if direct is not None:
                for key, g in direct:
                    _add(below, key, g)
                continue
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            targets = [GradientEdge(child, nr) for _, child, nr in edges]
            # autograd runs only the nodes on a path from the roots to the targets: when this
            # node alone feeds its frontier children, that is this node alone. A child another
            # node feeds too (a parameter used twice) is reached through the activation
            # gradients as well: those paths are muted, so that they do not run again.
            mute = ([n.register_prehook(lambda gs: tuple(None for _ in gs)) for n in others if n is not node]
                    if node in self.shared else [])
            try:
                got = torch.autograd.grad([e for e, _ in roots], targets, [g for _, g in roots],
                                          retain_graph=True, allow_unused=True)
            finally:
                for h in mute:
                    h.remove()
            for (_, child, nr), g in zip(edges, got):
                _add(below, (child, nr), g)
        leaves = {k: g for k, g in below.items() if k[0] in self.params}
        rest = {k: g for k, g in below.items() if k[0] not in self.params}
        got = {}
        if rest:
            accs = list(self.params)
            grads = torch.autograd.grad([GradientEdge(n, nr) for n, nr in rest], [GradientEdge(a, 0) for a in accs],
                                        list(rest.values()), retain_graph=True, allow_unused=True)
            got = {a: g for a, g in zip(accs, grads) if g is not None}
        for (acc, _), g in leaves.items():  # a frontier edge straight into a parameter (a bias)
            _add(got, acc, g)
        for acc, g in got.items():
            p = self.params[acc]
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.frontier, self.kept, self.independent, self.params = {}, {}, {}, {}
        self.shared = frozenset()


def _linear_weight_grads(node, grads, edges):
    """The frontier gradients of a linear layer's `AddmmBackward0` computed here, without an
    autograd call (each call walks the graph below its root, which costs more than the GEMM
    on small layers): the weight's `alpha * mat1^T dY` (into its `TBackward0`) and the bias's
    `beta * dY` summed over the rows (into its accumulator). None for anything else, which
    `apply` leaves to autograd: another node, a gradient it does not have, a bias that is not
    a plain vector, an edge it does not know."""
    if type(node).__name__ != "AddmmBackward0" or len(grads) != 1 or grads[0] is None:
        return None
    dy = grads[0]
    out = []
    with torch.no_grad():  # the saved input is part of the graph: build nothing on it
        for i, child, nr in edges:
            got = _linear_edge(node, dy, i, child)
            if got is None:
                return None
            out.append(((child, nr), got))
    return out


def _linear_edge(node, dy, i: int, child):
    """One frontier edge of a linear layer's AddmmBackward0 (`_linear_weight_grads`): the
    gradient entering `child`, or None for an edge this does not know."""
    if i == 2:  # mat2: the weight, transposed; its gradient in mat2's layout, as autograd's
        mat1, sizes, strides = node._saved_mat1, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
        if strides[0] == 1 and strides[1] == sizes[0]:  # column-major (a linear layer's W^T)
            g = dy.t().mm(mat1).t()
        else:
            g = mat1.t().mm(dy)
        alpha = node._saved_alpha
        return g if alpha == 1 else g * alpha
    if i == 0 and type(child).__name__ == "AccumulateGrad" and child.variable.dim() == 1 \
            and dy.dim() == 2 and child.variable.shape[0] == dy.shape[1]:
        beta = node._saved_beta
        return dy.sum(0) if beta == 1 else (dy * beta).sum(0)
    return None


def backward_input(outs: list, grads: list, inputs: list, params: list) -> tuple[list, DeferredWeightGrads]:
    """Gradients of `inputs` (leaves requiring grad) from `outs` with upstream `grads`, and what
    `DeferredWeightGrads.apply` needs to add the gradients of `params` later. The graph is kept."""
    users = _users([o.grad_fn for o in outs])
    accs = {_node(p): p for p in params}
    toward = _upward(list(accs), users)  # nodes a parameter's gradient flows through
    dependent = _upward([_node(t) for t in inputs], users) if inputs else set()
    frontier: dict = {}
    for node in dependent & toward:
        edges = [(i, child, nr) for i, (child, nr) in enumerate(node.next_functions)
                 if child is not None and child not in dependent and child in toward]
        if edges:
            frontier[node] = edges
    independent: dict = {}
    for o, g in zip(outs, grads):
        if o.grad_fn not in dependent and o.grad_fn in toward:
            _add(independent, (o.grad_fn, o.output_nr), g)
    kept: dict = {}

    def keep(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    handles = [n.register_prehook(keep(n)) for n in frontier]
    try:
        got = (torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
               if inputs else [])
    finally:
        for h in handles:
            h.remove()
    shared = frozenset(node for node, edges in frontier.items()
                       if any(len(users.get(child, ())) > 1 for _, child, _ in edges))
    return list(got), DeferredWeightGrads(frontier, kept, independent, accs, shared)
