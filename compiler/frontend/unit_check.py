"""The numeric self-check of a model built without weights: unit by unit.

`tpc compile` traces a model whose parameters are on the meta device (`weightless.py`), so the
self-check cannot run the whole model. It checks **each distinct unit** instead, with every
slicing the plan uses, at the plan's full length L when that is affordable (`check_length`):

1. the unit's parameters are made real (random values, the same for a name every time: normal
   with standard deviation 1/sqrt(fan-in) for matrices, 1 + noise for vectors);
2. the reference is the captured graph (before any pass: the model's own code) evaluated for
   that unit alone, from the value entering it (the token ids, or a random residual stream),
   each weight made only while the ops that read it run, attention 512 query rows at a time;
3. the unit's stage graph (what a rank runs) runs the same input slice by slice; its output must
   agree with the reference's within 1e-4 x (1 + max |reference|), compared a slice at a time,
   else the first value that differs is refused at its source line (`first_difference.py`), as
   for the whole-model check;
4. the parameters are freed, and the freed heap pages handed back to the system.

Units whose stage graphs are identical (the same ops on the same shapes; per-layer constants
compared by value) are checked once: a 32-layer Llama checks three units (embedding, one block,
norm + head). When the distinct units' two forwards at L would cost more than `CHECK_FLOPS`, the
check runs the same code at a shorter length L' with the plan's slicings scaled to it (the same
slice count, boundaries at the same fractions): a reduced instance, stated in docs/frontend.md.
Memory: the largest unit's weights plus its activations at the check's length (batch 1).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import NamedTuple

import torch
import torch.fx as fx

from tpc.compiler.frontend.heap import release_freed_memory
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
                    # (its bytes: numpy has no bfloat16, RecurrentGemma's normaliser is one)
                    hashlib.sha256(v.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                    .hexdigest()
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
        v = torch.randn(like.shape, generator=gen).div_(max(1, like.shape[-1]) ** 0.5)
    else:
        v = torch.randn(like.shape, generator=gen).mul_(0.1).add_(1.0)
    return v.to(like.dtype)


class _Values:
    """Parameters by name, made real on first use (`check_value`), over the model's own buffers;
    what `SlicedModel.stage_module(params_from=...)` reads."""

    def __init__(self, model: torch.nn.Module, fetch):
        self._meta = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        self._fetch = fetch  # the graph's own constants (a tensor the model's code made: lifted)
        self._real: dict[str, torch.nn.Parameter] = {}

    def _other(self, name: str):
        return self._buffers[name] if name in self._buffers else self._fetch(name)

    def get(self, name: str):
        """`fresh`'s value, kept for the unit's life (the stage module holds it)."""
        if name not in self._meta:
            return self._other(name)
        if name not in self._real:
            v = self.fresh(name)
            self._real[name] = v if isinstance(v, torch.nn.Parameter) else torch.nn.Parameter(v, False)
        return self._real[name]

    def fresh(self, name: str):
        """`get`'s value without keeping it: the reference holds a weight only while it runs the
        ops that read it."""
        if name in self._real:
            return self._real[name]
        p = self._meta.get(name)
        if p is not None:
            return p if p.device != META else check_value(name, p)
        return self._other(name)

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


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ROWS = 512  # query rows per reference attention call: its scores are heads x 512 x L, not heads x L x L


def _sdpa_by_query_rows(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **extra):
    """`scaled_dot_product_attention` computed `_ROWS` queries at a time: each query's output
    depends on its own row of scores only, so the result is the same, and the reference's CPU
    math kernel holds heads x 512 x L scores instead of heads x L x L (2 GB for a 7B model at
    L = 4096)."""
    lq, lk = q.size(-2), k.size(-2)
    if lq <= _ROWS or dropout_p:
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **extra)
    outs = []
    for a in range(0, lq, _ROWS):
        b = min(lq, a + _ROWS)
        if is_causal:  # query i sees keys 0..i (torch's is_causal: the top-left aligned lower triangle)
            rows = torch.arange(a, b, device=q.device).unsqueeze(1)
            mask = torch.arange(lk, device=q.device).unsqueeze(0) <= rows
        elif attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.size(-2) == lq:
            mask = attn_mask[..., a:b, :]
        else:
            mask = attn_mask
        outs.append(_SDPA(q[..., a:b, :], k, v, mask, 0.0, False, scale=scale, **extra))
    return torch.cat(outs, dim=-2)


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
                val = (_sdpa_by_query_rows(*args, **kwargs) if n.target is _SDPA else n.target(*args, **kwargs))
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


def _first_token_over(outs, ref, tol) -> int | None:
    """The first token whose sliced output (`outs`, slice by slice along dim 1) differs from
    `ref` by more than `tol`; compared a slice at a time, so no second full-length copy is made."""
    off = 0
    for y in outs:
        n = y.size(1)
        err = y.sub_(ref[:, off:off + n]).abs_()  # y is not used again
        bad = err.amax(dim=tuple(d for d in range(err.dim()) if d != 1)).gt(tol).nonzero()
        if bad.numel():
            return off + int(bad[0])
        off += n
        del y, err
        release_freed_memory()
    return None


def scaled_slicing(lens, length: int) -> list[int]:
    """`lens` (slice lengths) scaled to cover `length` tokens: as many slices (at most `length`),
    each boundary at the same fraction of the sequence, every slice at least one token."""
    total = sum(lens)
    count = min(len(lens), length)
    ends, acc = [], 0
    for ln in lens[:count - 1]:
        acc += ln
        ends.append(round(acc * length / total))
    bounds = [0]
    for i, e in enumerate(ends):  # strictly increasing, leaving a token for each later slice
        bounds.append(min(max(e, bounds[-1] + 1), length - (count - 1 - i)))
    bounds.append(length)
    return [b - a for a, b in zip(bounds, bounds[1:])]


CHECK_FLOPS = 8e12  # the self-check's arithmetic budget: one to two minutes on a 2-core machine


class UnitCheck(NamedTuple):
    """What the unit-by-unit self-check ran: the units checked and the length it ran them at."""

    units: list[int]
    length: int


def check_length(sliced, units, slicings, budget: float | None = None) -> int:
    """The length the distinct `units` are checked at: the plan's, when their two forwards (the
    reference and the sliced run) cost at most `budget` FLOPs by the cost model's count; else the
    longest shorter length that does, but never fewer tokens than the plan has slices, twice."""
    import numpy as np

    budget = CHECK_FLOPS if budget is None else budget
    full = sliced.seq_len
    lengths = np.arange(1, full + 1, dtype=np.float64)
    costs = sliced.unit_costs(lengths, 0.0, 1.0)
    flops = 2 * sum(np.asarray(costs[u].total("fwd").flops, dtype=np.float64) for u in units)
    fits = np.nonzero(flops <= budget)[0]
    longest = int(fits[-1]) + 1 if fits.size else 1
    floor = min(full, 2 * max(len(lens) for lens in slicings))
    return max(longest, floor)


BACKWARD_LENGTH = 64  # the backward's tokens (more when a slicing has over 32 slices)


def _check_unit_backward(sliced, unit, stage, values, names, x, ids, lens) -> None:
    """The backward of one unit (`backward_check.py`): its stage graph run with `lens` scaled to
    `BACKWARD_LENGTH` tokens (the plan's length when shorter) and back-propagated, against the
    captured graph's gradients at that length: of the input and every parameter the unit uses."""
    seq = x.size(1)
    length = min(seq, max(BACKWARD_LENGTH, 2 * len(lens)))
    lens = scaled_slicing(lens, length) if length != seq else list(lens)
    x, ids = x[:, :length], ids[:, :length]
    params = {n: values.get(n) for n in names if n in values._meta}
    trainable = {n: p for n, p in params.items() if p.is_floating_point()}
    for p in trainable.values():
        p.requires_grad_(True)
        p.grad = None
    try:
        with torch.enable_grad():
            _unit_gradients(sliced, unit, stage, values, trainable, x, ids, lens)
    finally:
        for p in trainable.values():
            p.grad = None
            p.requires_grad_(False)


def _unit_gradients(sliced, unit, stage, values, trainable, x, ids, lens) -> None:
    from tpc.compiler.frontend.backward_check import compare_gradients, no_derivative, sliced_backward

    x_ref = x.detach().requires_grad_(True) if x.is_floating_point() else x
    out = _reference(sliced.original_graph, unit, x_ref, ids, values.get)
    if out is None or not out.requires_grad:  # nothing to compare with: the backward must run
        like = unit.output.meta["val"]
        weight = torch.randn(x.size(0), x.size(1), *like.shape[2:], generator=torch.Generator().manual_seed(1))
        sliced_backward(stage, x, lens, weight.to(like.dtype), sliced.context.model_file)
        return
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    try:
        (out * weight).sum().backward()
    except RuntimeError as e:  # the captured code itself, as rewritten (functional.py)
        raise no_derivative(sliced.original_graph, e, sliced.context.model_file) from None
    ref = {n: p.grad for n, p in trainable.items()}
    ref["the unit's input"] = x_ref.grad if x.is_floating_point() else None
    del out
    for p in trainable.values():
        p.grad = None
    got = {n: p.grad for n, p in trainable.items()}
    got["the unit's input"] = sliced_backward(stage, x, lens, weight, sliced.context.model_file)
    got.update({n: p.grad for n, p in trainable.items()})
    compare_gradients(got, ref, f"unit {unit.label!r}, slices {lens}")


def check_units(sliced, slicings, run_sliced, refuse_difference, length: int | None = None) -> UnitCheck:
    """The self-check of the module docstring for `sliced` (a SlicedModel whose model may hold
    no weights) with each slicing of `slicings`, at `length` tokens (None: `check_length`'s);
    returns what it ran. `run_sliced(stage, x, lens)`: the outputs, slice by slice (an
    iterable); `refuse_difference(token, lens, node)` raises."""
    ctx = sliced.context
    units = distinct_units(sliced)
    seq = check_length(sliced, units, slicings) if length is None else length
    if seq != sliced.seq_len:
        slicings = [scaled_slicing(lens, seq) for lens in slicings]
    values = _Values(sliced.model, ctx.fetch)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sliced.vocab, (1, seq), generator=gen)
    for u in units:
        unit = ctx.units[u]
        graph, _ = build_stage_graph(ctx, u, u + 1, with_loss=False)
        names = [n.target for n in graph.nodes if n.op == "get_attr"]
        x = ids if u == 0 else torch.randn(1, seq, sliced.hidden_size, generator=gen,
                                           dtype=unit.input.meta["val"].dtype)
        with torch.no_grad():
            # the reference first, each weight made while the ops that read it run; then the
            # stage, holding the unit's weights, runs the (smaller) slices
            ref = _reference(sliced.original_graph, unit, x, ids, values.fresh)
            release_freed_memory()
            stage = sliced.stage_module(u, u + 1, params_from=_UnitParams(values, names), with_loss=False)
            if ref is None:  # the passes renamed the unit's ends: the stage at full length is the reference
                ref = stage(x, 0, stage.empty_kv(1))[0]
            lo, hi = ref.aminmax()  # max |ref| without a full-size |ref|
            tol = 1e-4 * (1.0 + max(-lo.item(), hi.item()))
            for lens in slicings:
                token = _first_token_over(run_sliced(stage, x, lens), ref, tol)
                if token is not None:
                    from tpc.compiler.frontend.first_difference import first_difference_of

                    _, kept = _reference(sliced.original_graph, unit, x, ids, values.get, keep=True) or (None, {})
                    node = first_difference_of(sliced.original_graph, kept, ctx.seq_sym, x, lens, stage)
                    refuse_difference(token, lens, node)
            del ref
            _check_unit_backward(sliced, unit, stage, values, names, x, ids, slicings[0])
        values = _Values(sliced.model, ctx.fetch)  # the unit's weights freed
        del stage
        release_freed_memory()
    return UnitCheck(units, seq)
