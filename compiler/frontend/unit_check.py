"""The numeric self-check of a model built without weights: unit by unit.

`tpc compile` traces a model whose parameters are on the meta device (`weightless.py`), so the
self-check cannot run the whole model. It checks **each distinct unit** instead, at the plan's
full length L, with every slicing the plan uses:

1. the unit's parameters are made real (random values, the same for a name every time: normal
   with standard deviation 1/sqrt(fan-in) for matrices, 1 + noise for vectors);
2. the reference is the captured graph (before any pass: the model's own code) evaluated for
   that unit alone, from the value entering it (the token ids, or a random residual stream);
3. the unit's stage graph (what a rank runs) runs the same input slice by slice; its output must
   agree with the reference's within 1e-4 x (1 + max |reference|), else the first value that
   differs is refused at its source line (`first_difference.py`), as for the whole-model check;
4. the parameters are freed before the next unit.

Units whose stage graphs are identical (the same ops on the same shapes; per-layer constants
compared by value) are checked once: a 32-layer Llama checks three units (embedding, one block,
norm + head). Memory: the largest unit's weights plus its activations at length L (batch 1);
time: two forwards (sliced and not) of each distinct unit at length L.
"""

from __future__ import annotations

import hashlib
import zlib

import torch
import torch.fx as fx

from tpc.compiler.frontend.stage import build_stage_graph

META = torch.device("meta")


def unit_signature(graph: fx.Graph, fetch) -> str:
    """What makes two units' stage graphs the same code: each node's op, target and arguments
    (nodes by position), parameters by shape and dtype, other constants by value."""
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()

    def arg(a):
        return f"%{index[a]}" if isinstance(a, fx.Node) else repr(a)

    for i, n in enumerate(graph.nodes):
        index[n] = i
        if n.op == "get_attr":
            v = fetch(n.target)
            if isinstance(v, torch.nn.Parameter) or (isinstance(v, torch.Tensor) and v.is_meta):
                part = f"param {tuple(v.shape)} {v.dtype}"
            elif isinstance(v, torch.Tensor):
                part = f"const {tuple(v.shape)} {v.dtype} " + (
                    hashlib.sha256(v.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
                    if v.numel() <= 1 << 22 else "")
            else:
                part = f"const {v!r}"
        elif n.op == "placeholder":
            part = "placeholder"
        else:
            args = fx.node.map_aggregate(n.args, arg)
            kwargs = fx.node.map_aggregate(n.kwargs, arg)
            part = f"{n.op} {n.target} {args} {kwargs}"
        h.update(part.encode())
        h.update(b"\n")
    return h.hexdigest()


def distinct_units(sliced) -> list[int]:
    """The first unit of each distinct stage graph, in order."""
    ctx = sliced.context
    seen: dict[str, int] = {}
    for u in range(sliced.num_units):
        graph, _ = build_stage_graph(ctx, u, u + 1, with_loss=False)
        seen.setdefault(unit_signature(graph, ctx.fetch), u)
    return sorted(seen.values())


def check_value(name: str, like: torch.Tensor) -> torch.Tensor:
    """The self-check's value of parameter `name` (shaped and typed as `like`): the same for a
    name every time."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if not like.dtype.is_floating_point:
        return torch.zeros(like.shape, dtype=like.dtype)
    if like.dim() >= 2:
        v = torch.randn(like.shape, generator=gen) / max(1, like.shape[-1]) ** 0.5
    else:
        v = 1.0 + 0.1 * torch.randn(like.shape, generator=gen)
    return v.to(like.dtype)


class _Values:
    """Parameters by name, made real on first use (`check_value`), over the model's own buffers;
    what `SlicedModel.stage_module(params_from=...)` reads."""

    def __init__(self, model: torch.nn.Module):
        self._meta = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        self._real: dict[str, torch.nn.Parameter] = {}

    def get(self, name: str):
        if name in self._meta:
            if name not in self._real:
                p = self._meta[name]
                self._real[name] = p if p.device != META else torch.nn.Parameter(check_value(name, p), False)
            return self._real[name]
        return self._buffers.get(name)

    def named_parameters(self):
        return [(n, self.get(n)) for n in self._meta]

    def named_buffers(self):
        return list(self._buffers.items())


class _UnitParams:
    """Only the parameters one unit's stage names are made real (stage_module asks for all)."""

    def __init__(self, values: _Values, names):
        self.values, self.names = values, set(names)

    def named_parameters(self):
        return [(n, self.values.get(n)) for n in self.names if n in self.values._meta]

    def named_buffers(self):
        return self.values.named_buffers()


class NodeFailed(Exception):
    """A node of the captured graph raised when evaluated at the plan's length."""

    def __init__(self, node: fx.Node, error: BaseException):
        super().__init__(str(error))
        self.node, self.error = node, error


def _reference(captured: fx.Graph, unit, x: torch.Tensor, ids: torch.Tensor, get, keep: bool = False):
    """The captured graph's value of `unit`'s output (by node name) from `x` entering it, every
    other value it needs computed from the ids (sizes), buffers and parameters (`get`); None when
    the captured graph has no such nodes. `keep`: also every value computed, by name."""
    by_name = {n.name: n for n in captured.nodes}
    out = by_name.get(unit.output.name)
    start = by_name.get(unit.input.name)
    if out is None or start is None:
        return None
    need, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n is not start:
            stack.extend(n.all_input_nodes)
    order = [n for n in captured.nodes if n in need]
    last_use = {}
    for i, n in enumerate(order):
        for a in n.all_input_nodes:
            last_use[a] = i
    env: dict[fx.Node, object] = {}
    kept: dict[str, object] = {}
    for i, n in enumerate(order):
        if n is start:
            val = x
        elif n.op == "placeholder":
            val = ids
        elif n.op == "get_attr":
            val = get(n.target)
        elif n.op == "call_function":
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            try:
                val = n.target(*args, **kwargs)
            except (IndexError, RuntimeError, ValueError) as e:
                raise NodeFailed(n, e) from None
        else:
            return None
        env[n] = val
        if keep:
            kept[n.name] = val
        for a in n.all_input_nodes:
            if last_use.get(a) == i and a is not out:
                env.pop(a, None)
    return (env[out], kept) if keep else env[out]


def check_units(sliced, slicings, run_sliced, refuse_difference) -> list[int]:
    """The self-check of the module docstring for `sliced` (a SlicedModel whose model may hold
    no weights) with each slicing of `slicings`; returns the units checked.
    `run_sliced(stage, x, lens) -> [outputs]`; `refuse_difference(x, lens, stage, node)` raises."""
    ctx = sliced.context
    seq = sliced.seq_len
    values = _Values(sliced.model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sliced.vocab, (1, seq), generator=gen)
    units = distinct_units(sliced)
    for u in units:
        unit = ctx.units[u]
        graph, _ = build_stage_graph(ctx, u, u + 1, with_loss=False)
        names = [n.target for n in graph.nodes if n.op == "get_attr"]
        stage = sliced.stage_module(u, u + 1, params_from=_UnitParams(values, names), with_loss=False)
        x = ids if u == 0 else torch.randn(1, seq, sliced.hidden_size, generator=gen,
                                           dtype=unit.input.meta["val"].dtype)
        with torch.no_grad():
            ref = _reference(sliced.original_graph, unit, x, ids, values.get)
            if ref is None:  # the passes renamed the unit's ends: the stage at full length is the reference
                ref = stage(x, 0, stage.empty_kv(1))[0]
            for lens in slicings:
                got = torch.cat(run_sliced(stage, x, lens), dim=1)
                err = (got - ref).abs()
                tol = 1e-4 * (1.0 + ref.abs().max().item())
                if err.max().item() > tol:
                    from tpc.compiler.frontend.first_difference import first_difference_of

                    _, kept = _reference(sliced.original_graph, unit, x, ids, values.get, keep=True) or (None, {})
                    node = first_difference_of(sliced.original_graph, kept, ctx.seq_sym, x, lens, stage)
                    token = int(err.amax(dim=tuple(d for d in range(err.dim()) if d != 1)).gt(tol).nonzero()[0])
                    refuse_difference(token, lens, node)
        values = _Values(sliced.model)  # the unit's weights freed
        del stage, ref
    return units
