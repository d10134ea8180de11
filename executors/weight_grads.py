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

What crosses the frontier is handled by the kind of the intermediate:

- A GEMM (`AddmmBackward0`, `MmBackward0`: linear layers, with or without a bias) is what the
  weight half exists for: its `dW = Xᵀ dY` is the expensive part of a weight gradient. The input
  half keeps the gradient the GEMM received (dY, a hook); the weight half computes `dW` and the
  bias's row sum from it directly (`_linear_edge`), without an autograd call (each call walks
  the graph below its root, which costs more than the GEMM on small layers).
- Any other intermediate (a layer norm, a bias added or a scale multiplied in, attention whose
  query comes from a first stage's own tokens, a concatenation of the cached prefix with the
  slice's own keys) computes its frontier gradients in the input half, in the same kernel that
  gives the input gradient: autograd is asked for those edges too, and a hook on the node takes
  what it hands each frontier child. Deferring them would mean running the node again in the
  weight half (for attention, its whole backward) to get a gradient that costs the input half
  almost nothing; what is held until the weight half is then that gradient (a norm's is the
  size of its weight, not of its output). One exception: asking autograd for a child makes it
  run every path to that child, so a node whose child lies below another asked child (a first
  stage's residual add, under its queries' projection) is run again in the weight half instead
  (`_rerun`), with the other intermediates muted.
- The weight half then makes one autograd call from the frontier edges, plus the outputs that do
  not depend on an input (a first stage's keys/values, into which later slices send gradients),
  down to the parameters.

Every gradient reaches a parameter once: along one frontier edge, or from an independent output.
The decomposition of `torch.distributed.pipelining`'s stage_backward_input/_weight, but cut at
single edges, so a parameter used in two places (tied embeddings) does not drag the activation
gradients between its uses into the weight half.
"""

from __future__ import annotations

import collections
import dataclasses
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

    frontier: dict  # GEMM intermediate -> [(index in next_functions, child node, input nr)]
    kept: dict  # GEMM intermediate -> the gradient it received in the input half (dY)
    independent: dict  # (output node, nr) -> upstream gradient, outputs not depending on inputs
    params: dict  # accumulator node -> parameter
    handed: dict  # (frontier child, nr) -> what the other intermediates handed it in the input half
    # intermediates run again in the weight half, and the nodes muted while one of them runs
    # (`_rerun`); only for a node the input half cannot ask (the module docstring)
    rerun: dict = dataclasses.field(default_factory=dict)
    mute: tuple = ()

    def held_bytes(self) -> int:
        """Bytes of the gradients kept for the weight half (each storage once): what a split
        backward holds between its halves beyond the forward's stash."""
        grads = [g for gs in self.kept.values() for g in gs] + list(self.independent.values()) \
            + list(self.handed.values())
        seen = {storage_key(g): g.untyped_storage().nbytes() for g in grads if g is not None}
        return int(sum(seen.values()))

    def apply(self) -> None:
        """Add the slice's parameter gradients into `.grad`, each as soon as it is computed (so
        that no second copy of the stage's gradients builds up); the state is dropped."""
        below: dict = dict(self.independent)  # (node, nr) -> gradient entering it
        for key, g in self.handed.items():
            _add(below, key, g)
        with torch.no_grad():  # the saved inputs are part of the graph: build nothing on them
            for node, edges in self.frontier.items():
                grads = self.kept.get(node)
                if grads is None or grads[0] is None:  # no gradient reached it
                    continue
                for i, child, nr in edges:
                    g = _linear_edge(node, grads[0], i)
                    if not self._into_param(child, g):
                        _add(below, (child, nr), g)
        for node, edges in self.rerun.items():
            for key, g in self._rerun(node, edges):
                _add(below, key, g)
        rest = {}
        for (node, nr), g in below.items():
            if not self._into_param(node, g):
                rest[node, nr] = g
        if rest:  # the independent part of the graph, down to the parameters (accumulated there)
            torch.autograd.backward([GradientEdge(n, nr) for n, nr in rest], list(rest.values()),
                                    retain_graph=True, inputs=list(self.params.values()))
        self.frontier, self.kept, self.independent, self.params, self.handed = {}, {}, {}, {}, {}
        self.rerun, self.mute = {}, ()

    def _into_param(self, node, g) -> bool:
        """Add `g`, the gradient entering `node`, to a parameter's `.grad` when `node` is the
        parameter's accumulator (a bias) or its transpose (a linear layer's weight); False for
        anything else."""
        if node not in self.params:
            if type(node).__name__ != "TBackward0" or node.next_functions[0][0] not in self.params:
                return False
            node, g = node.next_functions[0][0], g.t()
        p = self.params[node]
        if g.stride() != p.stride():
            g = g.contiguous() if p.is_contiguous() else torch.empty_like(p).copy_(g)
        p.grad = g if p.grad is None else p.grad.add_(g)
        return True

    def _rerun(self, node, edges):
        """An intermediate's frontier gradients from the gradients it received in the input
        half, by autograd asked only for its frontier edges: it runs this node alone, and the
        other intermediates are muted, so that a child they feed too gets nothing twice."""
        grads = self.kept.get(node)
        if grads is None or all(g is None for g in grads):
            return []
        roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
        mute = [n.register_prehook(lambda gs: tuple(None for _ in gs)) for n in self.mute if n is not node]
        try:
            got = torch.autograd.grad([e for e, _ in roots], [GradientEdge(child, nr) for _, child, nr in edges],
                                      [g for _, g in roots], retain_graph=True, allow_unused=True)
        finally:
            for h in mute:
                h.remove()
        return [((child, nr), g) for (_, child, nr), g in zip(edges, got)]


def _deferred(node, edges) -> bool:
    """Whether the weight half computes this intermediate's frontier gradients itself: a linear
    layer's GEMM whose every frontier edge `_linear_edge` knows. Anything else hands its
    frontier gradients over in the input half (the module docstring)."""
    kind = type(node).__name__
    if kind == "MmBackward0":  # self @ mat2, mat2 the weight (transposed)
        return all(i == 1 for i, _, _ in edges)
    if kind != "AddmmBackward0":  # beta * bias + alpha * (mat1 @ mat2)
        return False
    out = node._saved_mat2_sym_sizes[1]
    return all(i == 2 or (i == 0 and type(child).__name__ == "AccumulateGrad" and child.variable.dim() == 1
                          and child.variable.shape[0] == out) for i, child, _ in edges)


def _linear_edge(node, dy, i: int):
    """The gradient a linear layer's GEMM (`_deferred`) sends along frontier edge `i`, from the
    gradient `dy` it received: the weight's `alpha * mat1^T dy` in the layout autograd gives it
    (into its `TBackward0`), or the bias's `beta * dy` summed over the rows."""
    if type(node).__name__ == "MmBackward0":
        x, sizes, strides, alpha = node._saved_self, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides, 1
    elif i == 2:
        x, sizes, strides, alpha = (node._saved_mat1, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides,
                                    node._saved_alpha)
    else:
        beta = node._saved_beta
        return dy.sum(0) if beta == 1 else (dy * beta).sum(0)
    if strides[0] == 1 and strides[1] == sizes[0]:  # column-major (a linear layer's W^T)
        g = dy.t().mm(x).t()
    else:
        g = x.t().mm(dy)
    return g if alpha == 1 else g * alpha


def backward_input(outs: list, grads: list, inputs: list, params: list) -> tuple[list, DeferredWeightGrads]:
    """Gradients of `inputs` (leaves requiring grad) from `outs` (tensors or their gradient
    edges) with upstream `grads`, and what
    `DeferredWeightGrads.apply` needs to add the gradients of `params` later. The graph is kept."""
    users = _users([_edge(o)[0] for o in outs])
    accs = {_node(p): p for p in params}
    toward = _upward(list(accs), users)  # nodes a parameter's gradient flows through
    dependent = _upward([_node(t) for t in inputs], users) if inputs else set()
    frontier, handing = {}, {}
    for node in dependent & toward:
        edges = [(i, child, nr) for i, (child, nr) in enumerate(node.next_functions)
                 if child is not None and child not in dependent and child in toward]
        if edges:
            (frontier if _deferred(node, edges) else handing)[node] = edges
    # Asking autograd for a child makes it run every path to it: a child below another asked
    # one (a first stage's residual add, under its queries' projection) would drag the
    # projection's input gradient into this half. Such an intermediate is run again instead.
    below = _downward([child for edges in handing.values() for _, child, _ in edges])
    rerun = {n: edges for n, edges in handing.items() if any(child in below for _, child, _ in edges)}
    for n in rerun:
        del handing[n]
    independent: dict = {}
    for o, g in zip(outs, grads):
        node, nr = _edge(o)
        if node not in dependent and node in toward:
            _add(independent, (node, nr), g)
    kept: dict = {}
    handed: dict = {}

    def keep(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    def hand(edges):
        def hook(grad_inputs, grad_outputs):
            for i, child, nr in edges:
                _add(handed, (child, nr), grad_inputs[i])
        return hook

    handles = [n.register_prehook(keep(n)) for n in (*frontier, *rerun)]
    handles += [n.register_hook(hand(edges)) for n, edges in handing.items()]
    # the handing nodes' frontier edges are asked for too, so that autograd computes them; what
    # it returns for them is not used (a child's total may mix in others), the hooks' values are
    asked = list(dict.fromkeys(GradientEdge(child, nr) for edges in handing.values() for _, child, nr in edges))
    try:
        got = (torch.autograd.grad(outs, list(inputs) + asked, grads, retain_graph=True, allow_unused=True)
               if inputs else [])
    finally:
        for h in handles:
            h.remove()
    return list(got)[:len(inputs)], DeferredWeightGrads(frontier, kept, independent, accs, handed, rerun,
                                                        tuple((*frontier, *rerun, *handing)))


def _edge(out) -> tuple:
    """(node, output nr) of an output: a tensor, or a gradient edge standing for one."""
    if isinstance(out, GradientEdge):
        return out.node, out.output_nr
    return out.grad_fn, out.output_nr


def _downward(starts) -> set:
    """The nodes reached from `starts` along at least one edge."""
    seen: set = set()
    todo = collections.deque(n for s in starts for n, _ in s.next_functions if n is not None)
    while todo:
        node = todo.popleft()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return seen
