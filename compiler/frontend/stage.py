"""Stage graphs and `StageModule`: units [lo, hi) of the rewritten graph as one runnable slice
function.

A stage graph takes (x, offset, k_prefix_0, v_prefix_0, ..., [targets]) and returns
(y, k_0, v_0, ...): x is the token ids on the first stage, else the residual stream entering
unit lo; y is the residual leaving unit hi-1, or on the last stage the summed token loss. The
cached tensors are an attention's keys and values and a causal mixer's input (`state_prefix_i`,
`carried_state.py`), in graph order. Static
values the stage needs (weight views, position tables) are recomputed inside it; the batch and
sequence sizes are re-read from x.

A stage graph does not depend on the device the capture ran on: export records a factory's
device as a constant (`arange(..., device=cpu)` for positions, `zeros`/`full` of shape-only
values, `.to(device)`), so every `torch.device` argument of a copied node becomes `x.device`, one
`getattr` node on the stage's input. A stage built once runs on any device its parameters are
moved to (`stage.to(device)`), with no code generated again. Tensor constants export lifted out
of forward are registered as (non-persistent) buffers, so `.to()` moves them too.

A stage graph does not depend on the layout the capture happened to see: `view` (and
`_unsafe_view`) become `reshape`. The capture records the strides of one run (the CPU's SDPA
kernel, say), and a `view` there may have lost a `.contiguous()` the model wrote, which the
trace dropped because the traced value was already contiguous; another SDPA backend (CUDA's
math or memory-efficient path) lays its output out otherwise, and the `view` would fail.
`reshape` is the same view whenever a view is possible, so on the traced layout the numbers do
not change, and it copies only where the layout needs it, as the model's `.contiguous()` did.
Restoring the dropped `.contiguous()` instead would need to know where the model wrote one,
which the trace does not record. The cost records keep the captured op's (a view is free on the
traced layout).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from tpc.compiler.frontend import runtime_ops
from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.context import CacheSite, PassContext
from tpc.compiler.frontend.data_independent import is_size_root, prune_dead
from tpc.compiler.frontend.flops import FREE

aten = torch.ops.aten

# ops that need a particular input layout, and the op that takes any layout to the same value
_ANY_LAYOUT = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def build_stage_graph(ctx: PassContext, lo: int, hi: int, with_loss: bool,
                      dropped: frozenset[int] = frozenset()) -> tuple[fx.Graph, list[CacheSite]]:
    """Extract units [lo, hi) of the front end's final context (`SlicedModel.context`) into a
    new graph; returns it and the cache sites of those units, in graph order. Each unit of
    `dropped` runs on the tokens a `keep_U` placeholder names (random layerwise token dropping,
    `random_ltd.py`)."""
    from tpc.compiler.frontend.random_ltd import check_droppable, copy_dropped_unit

    units = ctx.units[lo:hi]
    sites = [s for s, u in zip(ctx.cache_sites, ctx.site_units) if lo <= u < hi]
    drop = sorted(u for u in dropped if lo <= u < hi)
    check_droppable(ctx, drop)
    g = fx.Graph()
    x = g.placeholder("x")
    off = g.placeholder("offset")
    env: dict[fx.Node, fx.Node] = {units[0].input: x, ctx.offset: off}
    prefixes = [prefix for s in sites for _, prefix, _, _ in s.cached]
    for prefix in prefixes:
        env[prefix] = g.placeholder(prefix.target)
    keeps = {u: g.placeholder(f"keep_{u}") for u in drop}
    targets = g.placeholder("targets") if (with_loss and hi == len(ctx.units)) else None
    last_placeholder = targets or (keeps[drop[-1]] if drop else env[prefixes[-1]] if prefixes else off)
    device: list[fx.Node] = []  # x.device, made when a node first needs it

    def input_device() -> fx.Node:
        if not device:
            with g.inserting_after(last_placeholder):
                node = g.create_node("call_function", getattr, (x, "device"), name="input_device")
            node.meta["tpc_cost"] = FREE
            device.append(node)
        return device[0]

    def on_input_device(a):
        return input_device() if isinstance(a, torch.device) else a

    def copy(n: fx.Node, resolve=None) -> fx.Node:
        new = g.node_copy(n, resolve or get)
        if new.op == "call_function":
            if new.target in _ANY_LAYOUT:
                new.target = _ANY_LAYOUT[new.target]
            if _names_a_device((new.args, new.kwargs)):
                new.args = fx.node.map_aggregate(new.args, on_input_device)
                new.kwargs = fx.node.map_aggregate(new.kwargs, on_input_device)
        return new

    def get(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if is_size_root(n, ctx.batch_sym, ctx.seq_sym):
            dim = 0 if size_expr(n.meta["val"]) == ctx.batch_sym else 1
            new = g.call_function(torch.ops.aten.sym_size.int, (x, dim))
        elif n in ctx.static:
            new = g.get_attr(n.target) if n.op == "get_attr" else copy(n)
            new.meta = dict(n.meta)
        else:
            raise RuntimeError(f"internal: value {n.name} crosses the stage cut before unit {lo}")
        env[n] = new
        return new

    for i, u in enumerate(units, start=lo):
        if i in keeps:
            copy_dropped_unit(ctx, g, u, keeps[i], env, get, copy)
            continue
        for n in u.nodes:
            if n.op == "placeholder":
                continue
            env[n] = copy(n)
    y = get(units[-1].output)
    if targets is not None:
        y = g.call_function(runtime_ops.sum_token_loss, (y, targets))
    outs = [y]
    for s in sites:
        outs += [get(value) for value, *_ in s.cached]
    g.output(tuple(outs))
    prune_dead(g)
    g.lint()
    return g, sites


def graph_function(graph: fx.Graph, name: str):
    """(`graph` as a Python function `f(module, *inputs)` whose get_attr nodes read off
    `module`, its source)."""
    code = graph.python_code(root_module="self")
    glb = dict(code.globals)
    exec(compile(code.src, name, "exec"), glb)  # noqa: S102 - code generated from our own graph
    return glb["forward"], code.src


def _names_a_device(args) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, torch.device) else None)
    return bool(found)


def _set_attr(root: nn.Module, name: str, value, kind: str) -> None:
    *path, field = name.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if kind == "param":
        mod.register_parameter(field, value)
    elif kind == "buffer":
        mod.register_buffer(field, value)
    elif isinstance(value, torch.Tensor):  # a constant of the capture: moved with the stage
        mod.register_buffer(field, value, persistent=False)
    else:
        setattr(mod, field, value)


class StageModule(nn.Module):
    """Units [lo, hi) of a sliced model, run one token slice at a time.

    forward(x, offset, kv_prefix, targets=None) -> (y, kv_new). Parameters keep the original
    model's names, so optimizers, tying and checkpoints can match them. A prefix of a cached
    tensor with a window (`kv_windows`) may be cut to its last w - 1 tokens: the result is the
    same."""

    # how many parts of a slice's tokens the stage's input activation holds one of (sequence
    # parallelism over a tensor group: T, but 1 on the first stage, whose input is the token
    # ids; compiler/tensor/sequence.py)
    token_parts = 1

    def __init__(self, graph: fx.Graph, attrs: dict, lo: int, hi: int, num_units: int,
                 kv_dims: list[int], kv_shapes: list, kv_dtypes: list, label: str = "", has_loss: bool = True,
                 kv_windows: list | None = None, dropped: tuple[int, ...] = (), documents: bool = False):
        super().__init__()
        # the units that run on a subset of each slice's tokens (random layerwise token
        # dropping): forward takes the kept tokens of each, `keep`
        self.dropped = tuple(dropped)
        for name, (kind, value) in sorted(attrs.items()):
            _set_attr(self, name, value, kind)
        self.lo, self.hi, self.num_units = lo, hi, num_units
        self.is_first, self.is_last = lo == 0, hi == num_units
        self.kv_dims = list(kv_dims)
        self.num_kv = len(kv_dims)
        # per cached tensor: None, or the sliding window w of its attention (a later slice reads
        # only the last w - 1 tokens of it)
        self.kv_windows = list(kv_windows) if kv_windows is not None else [None] * self.num_kv
        self.label = label
        # over packed documents (`documents.py`): the graph takes each row's `DocumentSlice`,
        # and `forward` runs the rows one at a time
        self.documents = documents
        self.has_loss = has_loss and self.is_last
        # per cached tensor: batch -> its shape holding no tokens (the token axis 0), and its dtype
        self.kv_shapes, self.kv_dtypes = list(kv_shapes), list(kv_dtypes)
        self.graph = graph
        self._fn, self.code = graph_function(graph, f"<tpc stage {lo}:{hi}>")

    def forward(self, x, offset: int, kv_prefix: list, targets=None, keep: list | None = None, documents=None):
        """`keep`: with dropped units, per dropped unit the sorted int64 positions (within the
        slice) of the tokens it runs on; None runs every token through every unit. `documents`:
        over packed documents, each row's document starts (ascending host ints, the first 0;
        `StageModule(documents=True)` needs them)."""
        if len(kv_prefix) != self.num_kv:
            raise ValueError(f"stage {self.lo}:{self.hi} takes {self.num_kv} cached tensors, got {len(kv_prefix)}")
        if self.documents != (documents is not None):
            raise ValueError(f"stage {self.lo}:{self.hi} was built {'for' if self.documents else 'without'} "
                             f"packed documents and is run {'without' if documents is None else 'with'} them")
        if documents is not None:
            return self._forward_documents(x, int(offset), kv_prefix, targets, documents)
        args = [x, int(offset), *kv_prefix]
        if self.dropped:
            if keep is None:
                every = torch.arange(x.size(1) * self.token_parts, device=x.device)
                keep = [every] * len(self.dropped)
            if len(keep) != len(self.dropped):
                raise ValueError(f"stage {self.lo}:{self.hi} drops tokens in units {list(self.dropped)}, "
                                 f"got {len(keep)} sets of kept tokens")
            args += list(keep)
        elif keep:
            raise ValueError(f"stage {self.lo}:{self.hi} drops no tokens, got kept tokens for {len(keep)} units")
        if self.has_loss:
            if targets is None:
                raise ValueError("the last stage needs targets (B, l) int64 to compute the loss")
            args.append(targets)
        out = self._fn(self, *args)
        return out[0], list(out[1:])

    def _forward_documents(self, x, offset: int, kv_prefix: list, targets, documents):
        """One row at a time (each row's positions and documents are its own): the row's prefix
        narrowed to the tokens of the document its first token is in (none when the slice starts
        a document), its `DocumentSlice` given to the graph; the rows' outputs joined (the last
        stage's summed losses added)."""
        if len(documents) != x.size(0):
            raise ValueError(f"the document starts of {len(documents)} rows for a slice of {x.size(0)} rows")
        length = x.size(1) * self.token_parts
        ys, kvs = [], []
        for b, starts in enumerate(documents):
            doc = runtime_ops.document_slice(starts, offset, length, x.device)
            earlier = doc.keys - length  # the cached tokens this row's slice reads
            prefix = []
            for p, d, shape in zip(kv_prefix, self.kv_dims, self.kv_shapes):
                n = shape(1)[0]  # a row's entries on the first axis (BLOOM's: its heads)
                p = p.narrow(0, b * n, n)
                prefix.append(p.narrow(d, p.size(d) - earlier, earlier) if p.size(d) > earlier else p)
            args = [x.narrow(0, b, 1), offset, *prefix, doc]
            if self.has_loss:
                if targets is None:
                    raise ValueError("the last stage needs targets (B, l) int64 to compute the loss")
                args.append(targets.narrow(0, b, 1))
            out = self._fn(self, *args)
            ys.append(out[0])
            kvs.append(out[1:])
        y = sum(ys[1:], ys[0]) if self.has_loss else torch.cat(ys, dim=0)
        return y, [torch.cat(parts, dim=0) for parts in zip(*kvs)]

    def empty_kv(self, batch: int) -> list:
        """Zero-length prefixes (slice 0 has no cached tokens)."""
        dev = next(iter(self.parameters()), None)
        dev = dev.device if dev is not None else torch.device("cpu")
        return [torch.zeros(shape(batch), dtype=dt, device=dev) for shape, dt in zip(self.kv_shapes, self.kv_dtypes)]
