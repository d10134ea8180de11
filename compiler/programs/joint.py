"""A stage's programs for one slice shape, derived from its joint graph.

A stage graph (`compiler/frontend/stage.py`) says what one slice's forward computes. Its
backward, and the two halves a split-backward schedule runs apart (`backward-input`: the
gradients of the slice's input and of the cached prefix it read; `backward-weight`: the
parameter gradients), are derived here from one trace, not from the eager autograd graph:

1. **The joint graph.** The stage's forward and an autograd call over all its outputs (y and
   the keys/values it cached, each with an upstream gradient, a *tangent*) are traced together
   with `make_fx` into one aten graph: its inputs are the primals (parameters and buffers, x,
   the cached prefixes, the targets) and the tangents; its outputs the forward's outputs and the
   gradients of every input that has one. The ops are the ones autograd runs eagerly, so the
   numbers are the eager ones.
2. **Forward and backward.** The forward program is what the outputs need and no tangent
   touches. The backward program is everything else the gradients need. What it reads of the
   forward (an activation, a softmax statistic, an input) is *saved*: the forward returns it
   beside its outputs, and the slice holds it until its backward.
3. **Input and weight halves.** Of the backward, `backward_input` is what the gradients of x
   and of the prefixes need; `backward_weight` is what only the parameter gradients need. What
   the weight half reads of the input half (a linear layer's output gradient dY, say) and of the
   saved values is *held*: `backward_input` returns it, and the slice keeps it instead of the
   saved values until `backward_weight`. Every op runs in exactly one half, so the two halves
   cost one backward and give its numbers bitwise.

The programs are torch.fx GraphModules of aten ops; `compiled.py` hands them to torch.compile.
A trace is specialised to one slice shape (`Shape`: rows, tokens, position offset, prefix
lengths): the plan names every shape before step 1, so each is traced once (a stage's few
distinct slices: one program each).
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call


# make_fx keeps its tracing state in module globals: one trace at a time in a process (the
# interpreter runs a tensor group's ranks on threads, each tracing its own part of a stage).
# Nothing a trace runs communicates (the collectives are operators with fake kernels), so no
# trace waits for another thread while it holds this.
TRACING = threading.Lock()


@dataclass(frozen=True)
class Shape:
    """What one program is specialised to: a slice of `tokens` tokens of `rows` rows at position
    `offset`, reading `prefix[t]` cached tokens of each cached tensor t; and how it runs
    (device, autocast dtype or None, training or evaluation)."""

    rows: int
    tokens: int
    offset: int
    prefix: tuple[int, ...]
    device: str
    autocast: str | None
    grad: bool = True
    # the strides of x and of each prefix: a trace records views that hold for its layout only
    # (a prefix is a view into a cache buffer whose size the plan chooses)
    layout: tuple = ()

    @staticmethod
    def of(x: torch.Tensor, offset: int, prefix: list, kv_dims, grad: bool = True) -> "Shape":
        """The shape of a slice: `x` at `offset` reading `prefix` (cached tensors, token axes
        `kv_dims`), under the autocast in force."""
        kind = x.device.type
        autocast = str(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None
        return Shape(x.size(0), x.size(1), int(offset), tuple(p.size(d) for p, d in zip(prefix, kv_dims)),
                     str(x.device), autocast, grad, tuple(_layout(t) for t in (x, *prefix)))

    def describe(self) -> str:
        p = ",".join(map(str, sorted(set(self.prefix)))) or "0"
        return f"{self.rows}x{self.tokens} tokens at {self.offset} (prefix {p})"


def _layout(t: torch.Tensor) -> tuple:
    """A tensor's strides as far as they matter: a dimension of size 1 is never stepped along,
    so its stride (which differs between a slice of a longer tensor and a tensor of its own) is
    left out."""
    return tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))


@dataclass
class Programs:
    """The programs of one stage for one `Shape` (GraphModules; callables once compiled).

    forward(*state, x, *prefix, [targets]) -> [y, *kv, *computed]
    backward(*saved, *tangents) -> [*input grads, *param grads]
    backward_input(*saved, *tangents) -> [*input grads, *held]
    The saved values are the forward's inputs the backward reads (`saved_inputs`: their positions
    in the forward's inputs; the caller holds them, no program returns an input) and then what
    the forward computed for the backward (`computed`).
    backward_weight(*held) -> [*param grads]
    Input grads: x's (if it takes one) then each prefix's that takes one; param grads: one per
    trainable parameter (None where the slice sends it nothing)."""

    shape: Shape
    forward: Callable
    backward: Callable | None
    backward_input: Callable | None
    backward_weight: Callable | None
    num_kv: int
    saved_inputs: tuple[int, ...]
    input_grads: tuple[int, ...]  # positions in [x, *prefix] of the inputs taking a gradient
    graphs: dict  # program name -> its fx.GraphModule (before compilation)

    def op_counts(self) -> dict[str, int]:
        return {k: sum(1 for n in g.graph.nodes if n.op == "call_function") for k, g in self.graphs.items()}


def state_of(module: torch.nn.Module) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """(names, tensors, indices of the trainable parameters among them): everything a stage
    reads of its module, the order every program takes it in."""
    names, tensors, trainable = [], [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            trainable.append(len(names))
        names.append(name)
        tensors.append(p)
    for name, b in module.named_buffers():
        names.append(name)
        tensors.append(b)
    return names, tensors, trainable


def derive(module, shape: Shape, x: torch.Tensor, prefix: list, targets) -> Programs:
    """Trace the stage `module` (a StageModule) on one slice of `shape` and cut its programs.
    `x`, `prefix`, `targets` are example values of the shape (their numbers do not matter,
    nothing of them is kept)."""
    names, state, trainable = state_of(module)
    num_kv = module.num_kv
    if not shape.grad:
        return _forward_only(module, shape, names, state, x, prefix, targets, num_kv)
    with torch.no_grad():  # the outputs' shapes, for the upstream gradients' examples
        y0, kv0 = module(x, shape.offset, prefix, targets)
    takes_grad = [i for i, t in enumerate([x, *prefix]) if t.is_floating_point() and not (i == 0 and module.is_first)]
    # upstream gradients are traced, and must be given, contiguous
    tangents = [torch.zeros(y0.shape, dtype=y0.dtype, device=y0.device)] + [
        torch.zeros(k.shape, dtype=k.dtype, device=k.device) for k in kv0]

    def joint(primals, tangents):
        st, xx, pre, tg = primals
        with torch.enable_grad():
            y, kv = functional_call(module, dict(zip(names, st)), (xx, shape.offset, list(pre), tg), strict=False)
            ins = [xx, *pre]
            wrt = [ins[i] for i in takes_grad] + [st[i] for i in trainable]
            outs = [y, *kv]
            pairs = [(o, t) for o, t in zip(outs, tangents) if o.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True)
        return [*outs, *grads]

    primals = ([t.detach().requires_grad_(i in trainable) for i, t in enumerate(state)],
               _leaf(x, 0 in takes_grad), [_leaf(p, i + 1 in takes_grad) for i, p in enumerate(prefix)], targets)
    with TRACING:
        gm = make_fx(joint, tracing_mode="fake")(primals, tangents)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # make_fx names them after the arguments (an absent `targets` has a placeholder too: dropped)
    tangent_nodes = [n for n in placeholders if n.name.startswith("tangents")]
    primal_nodes = [n for n in placeholders if n.name.startswith("primals")][:len(state) + 1 + len(prefix)
                                                                          + (targets is not None)]
    outs = _outputs(gm)
    fwd_outs, grad_outs = outs[:1 + num_kv], outs[1 + num_kv:]
    input_grads, param_grads = grad_outs[:len(takes_grad)], grad_outs[len(takes_grad):]

    fwd_nodes = _with_getitems(_ancestors(fwd_outs, stop=set(placeholders)), gm.graph)
    if any(t in fwd_nodes for t in tangent_nodes):
        raise RuntimeError("internal: the forward reads an upstream gradient")
    bwd_nodes = _ancestors(grad_outs, stop=set(placeholders)) - fwd_nodes
    saved = _recompute_views(_read_by(bwd_nodes, fwd_nodes | set(primal_nodes), gm.graph), primal_nodes)
    saved_inputs = [n for n in primal_nodes if n in saved]
    saved = saved_inputs + [n for n in saved if n not in saved_inputs]
    forward = _extract(gm, primal_nodes, fwd_outs + saved[len(saved_inputs):], "forward")
    backward = _extract(gm, saved + tangent_nodes, input_grads + param_grads, "backward")
    input_nodes = _with_getitems(_ancestors(input_grads, stop=set(saved + tangent_nodes)), gm.graph)
    weight_nodes = _ancestors(param_grads, stop=set(saved + tangent_nodes)) - input_nodes
    # what the weight half reads of the input half and of the saved values, and the parameter
    # gradients the input half computes itself (a layer norm's: one kernel gives dx, dw and db)
    before = input_nodes | set(saved + tangent_nodes)
    held = _read_by(weight_nodes | {n for n in param_grads if n in before}, before, gm.graph)
    backward_input = _extract(gm, saved + tangent_nodes, input_grads + held, "backward_input")
    backward_weight = _extract(gm, held, param_grads, "backward_weight")
    graphs = {"forward": forward, "backward": backward, "backward_input": backward_input,
              "backward_weight": backward_weight}
    return Programs(shape, forward, backward, backward_input, backward_weight, num_kv,
                    tuple(primal_nodes.index(n) for n in saved_inputs), tuple(takes_grad), graphs)


def _forward_only(module, shape, names, state, x, prefix, targets, num_kv) -> Programs:
    def fwd(st, xx, pre, tg):
        y, kv = functional_call(module, dict(zip(names, st)), (xx, shape.offset, list(pre), tg), strict=False)
        return [y, *kv]

    with torch.no_grad(), TRACING:
        gm = make_fx(fwd, tracing_mode="fake")([t.detach() for t in state], x.detach(),
                                               [p.detach() for p in prefix], targets)
    # an absent `targets` has a placeholder too: dropped
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:len(state) + 1 + len(prefix)
                                                                       + (targets is not None)]
    forward = _extract(gm, placeholders, _outputs(gm), "forward")
    return Programs(shape, forward, None, None, None, num_kv, (), (), {"forward": forward})


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    t = t.detach()
    return t.requires_grad_(True) if grad else t


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0])


def _ancestors(outputs, stop: set) -> set:
    """The nodes `outputs` are computed from, up to (not including) the nodes of `stop`."""
    seen: set = set()
    todo = [o for o in outputs if isinstance(o, fx.Node) and o not in stop]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(a for a in n.all_input_nodes if a not in stop and a not in seen)
    return seen


def _with_getitems(nodes: set, graph: fx.Graph) -> set:
    """`nodes` and the elements taken out of their tuple results (an op with several outputs,
    a layer norm's mean and rstd, say): an element is read where its op runs, so a program
    hands on elements, never a tuple."""
    return nodes | {n for n in graph.nodes if n.target is operator.getitem and n.args[0] in nodes}


# views: free to make again, so a view of the inputs is made again in the backward rather than
# saved (a saved view is an output aliasing an input, which a compiled program must rebuild
# as a view at every call)
_VIEWS = {getattr(torch.ops.aten, name).default for name in ("t", "view", "_unsafe_view", "alias", "unsqueeze",
                                                              "squeeze", "expand", "permute", "detach")} | {
    torch.ops.aten.transpose.int, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
    torch.ops.aten.squeeze.dim, torch.ops.aten.reshape.default}


def _recompute_views(saved: list, primal_nodes: list) -> list:
    """`saved` with every view of the forward's inputs alone (a weight's transpose, say)
    replaced by the inputs it views: the backward makes the view again."""
    inputs = set(primal_nodes)
    memo: dict = {}

    def input_view(n) -> bool:
        if n not in memo:
            memo[n] = (n.op == "call_function" and n.target in _VIEWS and bool(n.all_input_nodes)
                       and all(a in inputs or input_view(a) for a in n.all_input_nodes))
        return memo[n]

    def roots(n) -> list:
        return [n] if n in inputs else [r for a in n.all_input_nodes for r in roots(a)]

    out: list = []
    for n in saved:
        for r in (roots(n) if input_view(n) else [n]):
            if r not in out:
                out.append(r)
    return out


def _read_by(users: set, producers: set, graph: fx.Graph) -> list:
    """The nodes of `producers` that a node of `users` reads (or is), in graph order."""
    read = {a for n in users - producers for a in n.all_input_nodes if a in producers} | (users & producers)
    return [n for n in graph.nodes if n in read]


def _extract(gm: fx.GraphModule, inputs: list, outputs: list, name: str) -> fx.GraphModule:
    """A GraphModule taking `inputs` (nodes of `gm`) as its placeholders, in order, and
    returning `outputs` (nodes, or None), made of the nodes of `gm` between them."""
    g = fx.Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"{n.name}")
        env[n].meta = dict(n.meta)
    needed = _ancestors(outputs, stop=set(inputs))
    for n in gm.graph.nodes:
        if n in needed and n not in env:
            if n.op == "placeholder":
                raise RuntimeError(f"internal: the {name} program reads {n.name}, which is not one of its inputs")
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output([env[o] if isinstance(o, fx.Node) else o for o in outputs])
    g.eliminate_dead_code()
    return fx.GraphModule(gm, g, class_name=name)
