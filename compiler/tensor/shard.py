"""The graph one tensor rank runs, and its parameters' slices.

`shard_graph(graph, plan, rank)` copies a stage graph (`compiler/frontend/stage.py`) and
rewrites it by the split `split.find_split` found:

- each input of a column-parallel region goes through f (`collectives.copy_to_region`: the
  identity forward, the gradient all-reduced backward) before the column-parallel matmuls
  that read it (one f per input value, shared by the q, k and v projections);
- a row-parallel matmul loses its bias, its partial product goes through g
  (`collectives.reduce_from_region`: all-reduce forward, identity backward), and the bias is
  added to the sum;
- the token embedding becomes `collectives.vocab_parallel_embedding` (the rank's vocabulary
  rows, ids outside them looking up zeros, the lookups summed with g); where a position table
  is folded into it (`SplitPlan.folded`), the token lookup is the rank's partial one
  (`vocab_lookup`), the position lookup the rank's columns (`column_lookup`), and g follows
  their add;
- where the LM head's logits go straight into the loss (the last stage), the loss becomes
  `collectives.vocab_parallel_sum_token_loss`: no rank holds all the logits; where they leave
  the stage (no loss), they are all-gathered over the vocabulary (`gather_from_region`);
- every shape a split value is reshaped, viewed, expanded or cut to names the rank's size: the
  entry of the split dimension (the heads of `view(B, T, H, D)`, the width of `view(-1, C)`,
  the sizes of a fused QKV's `split`) is divided by T; a `-1` is left as it is, since it is
  computed from the rank's own (smaller) input.

The collectives reach the group through one `get_attr` node, `tensor_group`, which the rank's
module holds (a `TensorGroup`, `collectives.py`).

`ParamShard` says how a full parameter is cut (its dimension and the segments cut into T
parts each): `take(full, rank)` is the rank's slice, `join(slices)` the full tensor again.
`shard_stage(sliced_model, lo, hi, degree, rank, group)` is the rank's `StageModule` of units
[lo, hi): its own copy of every parameter (slices where split), its caches holding its own heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.calls import call_args, op_name
from tpc.compiler.frontend.stage import StageModule, build_stage_graph
from tpc.compiler.tensor import collectives
from tpc.compiler.tensor.split import ParamSplit, SplitPlan, find_split, segment_sliced

GROUP_ATTR = "tensor_group"


@dataclass(frozen=True)
class ParamShard:
    """A parameter `name` cut along `dim` for `degree` ranks: that dimension is `segments`
    (full sizes, in order), each cut into `degree` equal contiguous parts; rank r holds part r
    of every segment. No segments: replicated (every rank holds it whole)."""

    name: str
    dim: int
    segments: tuple[int, ...]
    degree: int

    @classmethod
    def of(cls, ps: ParamSplit, degree: int) -> "ParamShard":
        return cls(ps.name, ps.dim, ps.segments, degree)

    @property
    def replicated(self) -> bool:
        return not self.segments or self.degree == 1

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """The index ranges [start, stop) along `dim` of the full tensor that `rank` holds."""
        out, start = [], 0
        for seg in self.segments:
            part = seg // self.degree
            out.append((start + rank * part, start + (rank + 1) * part))
            start += seg
        return out

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's slice of the full tensor (a new tensor)."""
        if self.replicated:
            return full.detach().clone()
        return torch.cat([full.detach().narrow(self.dim, a, b - a) for a, b in self.ranges(rank)], dim=self.dim)

    def join(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order (replicated: rank 0's)."""
        if self.replicated:
            return slices[0]
        pieces, at = [], 0  # where the segment's part starts in a rank's slice
        for seg in self.segments:
            part = seg // self.degree
            pieces += [s.narrow(self.dim, at, part) for s in slices]
            at += part
        return torch.cat(pieces, dim=self.dim)


def shard_graph(graph: fx.Graph, plan: SplitPlan, rank: int) -> fx.Graph:
    """The graph tensor rank `rank` of `plan.degree` runs (module docstring)."""
    T = plan.degree
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    f_of: dict[str, fx.Node] = {}  # a column region's input -> its f
    group: list[fx.Node] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    def group_node() -> fx.Node:
        if not group:
            with g.inserting_after(env[placeholders[-1]]):
                group.append(g.get_attr(GROUP_ATTR))
        return group[0]

    def get(n):
        return env[n]

    def f(x: fx.Node) -> fx.Node:
        if x.name not in f_of:
            f_of[x.name] = g.call_function(collectives.copy_to_region, (env[x], group_node()))
        return f_of[x.name]

    def per_rank(size, what):
        if isinstance(size, int) and size != -1:
            if size % T:
                raise RuntimeError(f"internal: {what} of size {size} does not divide by {T}")
            return size // T
        if isinstance(size, int):
            return size
        raise RuntimeError(f"internal: {what} has a symbolic size at the split dimension")

    narrowed: dict[fx.Node, fx.Node] = {}  # a replicated k or v -> the one head the rank reads
    folded_tokens = {tok for tok, _ in plan.folded.values()}
    folded_positions = {pos for _, pos in plan.folded.values()}
    for n in graph.nodes:
        if n.op == "output":
            env[n] = g.node_copy(n, lambda m: narrowed.get(m, env[m]))
            continue
        if n.op != "call_function":
            new = g.node_copy(n, get)
            env[n] = new
            continue
        name = op_name(n)
        s = plan.values.get(n.name)
        if n.name in plan.vocab_loss.values():  # the loss of logits split over the vocabulary
            logits, targets = env[n.args[0]], env[n.args[1]]
            vocab = int(n.args[0].meta["val"].shape[-1])
            new = g.call_function(collectives.vocab_parallel_sum_token_loss,
                                  (logits, targets, rank * (vocab // T), group_node()))
        elif n.name in plan.replicated_kv:
            head = plan.kv_head(n.name, rank)
            hkv, hq = plan.replicated_kv[n.name]
            for kv in n.args[1:3]:
                if kv not in narrowed:
                    narrowed[kv] = g.call_function(torch.ops.aten.narrow.default, (f(kv), 1, head, 1))
            new = g.node_copy(n, lambda m: narrowed.get(m, env[m]))
            if new.kwargs.get("rep", 1) != 1:
                new.kwargs = {**new.kwargs, "rep": hq // T}
        elif n.name in plan.embeddings:
            w, ids = env[n.args[0]], env[n.args[1]]
            vocab = int(n.args[0].meta["val"].shape[0])
            # aten.embedding(weight, ids, padding_idx=-1, ...): the padding row gets no gradient
            pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
            if n.name in folded_tokens:  # summed after the position table's columns are added
                new = g.call_function(collectives.vocab_lookup, (w, ids, rank * (vocab // T), pad))
            else:
                new = g.call_function(collectives.vocab_parallel_embedding,
                                      (w, ids, rank * (vocab // T), group_node(), pad))
        elif n.name in folded_positions:
            width = int(n.args[0].meta["val"].shape[1])
            new = g.call_function(collectives.column_lookup,
                                  (env[n.args[0]], env[n.args[1]], rank * (width // T), width))
        elif n.name in plan.folded:
            new = g.call_function(collectives.reduce_from_region, (g.node_copy(n, get), group_node()))
        elif n.name in plan.column:
            a = call_args(n)
            x = a["input"] if name == "linear" else (a["mat1"] if name == "addmm" else n.args[0])
            fx_ = f(x)
            new = g.node_copy(n, lambda m: fx_ if m is x else env[m])
            if n.name == plan.head and n.name not in plan.vocab_loss:
                new = g.call_function(collectives.gather_from_region, (new, -1, group_node()))
        elif n.name in plan.row:
            a = call_args(n)
            if name == "linear":
                prod = g.call_function(torch.ops.aten.linear.default, (env[a["input"]], env[a["weight"]]))
                bias = a.get("bias")
            elif name == "addmm":
                prod = g.call_function(torch.ops.aten.mm.default, (env[a["mat1"]], env[a["mat2"]]))
                bias = a["self"]  # beta = alpha = 1 (split.py refuses others)
            else:
                prod = g.node_copy(n, get)
                bias = None
            new = g.call_function(collectives.reduce_from_region, (prod, group_node()))
            prod.meta, new.meta = dict(n.meta), dict(n.meta)  # the sum's shape is the matmul's
            if bias is not None:
                new = g.call_function(torch.ops.aten.add.Tensor, (new, env[bias]))
        else:
            if s is not None and not isinstance(s, list):
                new = g.node_copy(n, lambda m: f(m) if m.name in plan.region_reads else env[m])
            else:
                new = g.node_copy(n, get)
            src = plan.values.get(n.args[0].name) if n.args and isinstance(n.args[0], fx.Node) else None
            if src is not None and not isinstance(src, list):
                _resize(new, n, name, s, src, per_rank)
        new.meta = dict(n.meta)
        env[n] = new
    g.lint()
    return g


def _resize(new: fx.Node, old: fx.Node, name: str, out, src, per_rank) -> None:
    """Give a reshape / expand / split of a split value the rank's sizes."""
    if name in ("reshape", "view", "_unsafe_view", "expand"):
        shape = list(new.args[1])
        shape[out.dim] = per_rank(shape[out.dim], f"{name} {old.name}")
        new.args = (new.args[0], shape, *new.args[2:])
    elif name == "unflatten":
        a = call_args(old)
        sizes = list(a["sizes"])
        i = out.dim - a["dim"] % old.args[0].meta["val"].dim()
        if 0 <= i < len(sizes):
            sizes[i] = per_rank(sizes[i], f"unflatten {old.name}")
        new.args = (new.args[0], a["dim"], sizes)
        new.kwargs = {}
    elif name in ("split", "split_with_sizes"):
        a = call_args(old)
        if a["dim"] % old.args[0].meta["val"].dim() != src.dim:
            return
        key = "split_size" if name == "split" else "split_sizes"
        sizes = a[key]
        sizes = [per_rank(x, name) for x in sizes] if isinstance(sizes, (list, tuple)) else per_rank(sizes, name)
        new.args = (new.args[0], sizes, a["dim"])
        new.kwargs = {}
    elif name == "slice" and call_args(old)["dim"] % old.args[0].meta["val"].dim() == src.dim:
        # a fused projection cut by slices: the segment's part in the rank's (smaller) layout
        a = call_args(old)
        i = segment_sliced(old, src)
        before = sum(src.segments[:i])
        start = per_rank(before, f"slice {old.name}") if before else 0
        new.args = (new.args[0], a["dim"], start, start + per_rank(src.segments[i], f"slice {old.name}"), 1)
        new.kwargs = {}
    elif name == "chunk":
        pass  # chunks of the rank's part: the count is the same


class TensorStage(StageModule):
    """One tensor rank's stage: a `StageModule` over the rank's graph, holding its own copy of
    every parameter (the rank's slice where split), the group the collectives use, and
    `shards`, every parameter's `ParamShard`."""

    shards: dict[str, ParamShard]
    plan: SplitPlan


def shard_stage(sm, lo: int, hi: int, degree: int, rank: int, group, params_from: nn.Module | None = None,
                with_loss: bool = True, evaluation: bool = False, held: dict | None = None,
                sequence: bool = False) -> TensorStage:
    """Tensor rank `rank`'s module of units [lo, hi) of the `SlicedModel` `sm`, split over
    `degree` ranks; `group` the rank's `TensorGroup`. Parameters are copied from `params_from`
    (default: the model) and cut by their `ParamShard`. `evaluation`: dropout off, as
    `SlicedModel.stage_module` builds it. `held` (name -> Parameter): the rank's parts already
    made, shared with its other stages (a tie on one rank, the evaluation's stages); the parts
    made here are added to it. `sequence`: with sequence parallelism (`sequence.py`): the stage's
    input and output activations are the rank's 1/T of the slice's tokens."""
    ctx = sm.context
    graph, sites = build_stage_graph(ctx, lo, hi, with_loss)
    if evaluation:
        from tpc.compiler.frontend.inference import without_dropout

        graph = without_dropout(graph)
    plan = find_split(graph, degree, ctx.param_names, ctx.model_file)
    rank_graph = shard_graph(graph, plan, rank)
    if sequence and degree > 1:
        from tpc.compiler.tensor.sequence import sequence_parallel

        rank_graph = sequence_parallel(rank_graph, degree, ctx.seq_sym, lo == 0, GROUP_ATTR)
    src = params_from if params_from is not None else sm.model
    params, buffers = dict(src.named_parameters()), dict(src.named_buffers())
    shards = {name: ParamShard.of(ps, degree) for name, ps in plan.params.items()}
    attrs = {GROUP_ATTR: ("const", group)}
    for n in rank_graph.nodes:
        if n.op != "get_attr" or n.target == GROUP_ATTR:
            continue
        t = n.target
        if held is not None and t in held:
            attrs[t] = ("param", held[t])
        elif t in params:
            p = params[t]
            part = nn.Parameter(shards[t].take(p, rank), requires_grad=p.requires_grad)
            attrs[t] = ("param", part)
            if held is not None:
                held[t] = part
        elif t in buffers:
            attrs[t] = ("buffer", buffers[t])
        else:
            attrs[t] = ("const", ctx.fetch(t))
    out = next(n for n in graph.nodes if n.op == "output")
    cached = list(out.args[0][1:])
    kv_dims, shapes, dtypes, windows = [], [], [], []
    one_head = {a.args[i].name for a in graph.nodes if a.name in plan.replicated_kv for i in (1, 2)}
    for (node, _, d, window), value in zip([c for s in sites for c in s.cached], cached):
        split = plan.values.get(value.name)
        if value.name in one_head:
            split = _OneHead(degree)
        kv_dims.append(d)
        shapes.append(_shape_fn(node.meta["val"], ctx.batch_sym, ctx.seq_sym, split, degree))
        dtypes.append(node.meta["val"].dtype)
        windows.append(window)
    labels = sm.unit_labels
    label = labels[lo] if hi - lo == 1 else f"{labels[lo]} .. {labels[hi - 1]}"
    stage = TensorStage(rank_graph, attrs, lo, hi, sm.num_units, kv_dims, shapes, dtypes, label, with_loss,
                        kv_windows=windows)
    stage.shards, stage.plan = shards, plan
    stage.token_parts = degree if sequence and degree > 1 and lo > 0 else 1
    return stage


class _OneHead:
    """The cache of a replicated key/value head: dimension 1 holds one head on every rank."""

    dim = 1

    def __init__(self, degree):
        self.degree = degree


def _shape_fn(val, b, t, split, degree):
    exprs = [size_expr(d) for d in val.shape]

    def shape(batch):
        dims = [int(e.subs({b: batch, t: 0})) for e in exprs]
        if isinstance(split, _OneHead):
            dims[1] = 1
        elif split is not None:
            dims[split.dim] //= degree
        return tuple(dims)
    return shape


def full_grads(stages: list[TensorStage]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at its full shape, from the T ranks' stages (rank order):
    split parameters joined from the ranks' slices, replicated ones rank 0's."""
    out = {}
    for name, shard in stages[0].shards.items():
        grads = [dict(s.named_parameters())[name].grad for s in stages]
        if any(gr is None for gr in grads):
            continue
        out[name] = shard.join(grads)
    return out
