"""Rewrite pass: causal state carried across slices, the KV cache generalised to short causal
mixers.

An op whose output at token t reads the tokens [t - k + 1, t] of its input (a convolution
along the sequence padded on the left by k - 1, Mamba's and Hyena's short filters; RWKV's token
shift `ZeroPad2d((0, 0, 1, -1))`; a pad followed by `unfold`) needs, in a slice, the last k - 1
tokens of the slices before it. Every such op starts at a pad along the sequence, which is where
the past enters: the pad of `x` by p tokens before (and r after) becomes
`runtime_ops.causal_pad(x, prefix, dim, p, r, value)`, where `prefix` is a new placeholder holding the
last p tokens of `x` from the earlier slices (the pad value where the sequence has none). `x` is
cached the way attention keys are: the stage returns the slice's `x`, the runtime keeps its last
p tokens (a window of p + 1: `StageModule.kv_windows`), and a later slice reads them as a leaf
that requires grad, whose gradient flows back when the earlier slice runs backward (covered by
the slice order the verifier enforces). With slices shorter than p the prefix spans several
slices; the runtime's windowed cache joins them.

Forms brought to a pad first: a convolution's own padding (`Conv1d(padding=k - 1)` and a slice
`[..., :T]`, as Mamba and LFM2 write it) becomes an explicit pad; `cat([zeros, x[:, :-1]])` and
`pad(x[:, :-1], (0, 0, 1, 0))` become `pad(x, (1, -1))`.

Then every data value is followed through the rest of the graph as (a, e): the slice's value
has l + a entries along the sequence (the unsliced one T + a) and its entry i is the unsliced
value's entry offset + i for i < l + e. A pad by (p, r) gives (a + p + r, e + p) at an entry,
a convolution or unfold of span s (dilation x (kernel - 1)) takes s from both, a slice starting
at s0 takes s0 from e, per-token ops keep them. Entries past l + e differ from the unsliced
model (they read padding where the unsliced model has later tokens): a value that still has
any (e < a) where it is used as a whole (the model's output, an attention's q, k or v, a cached
value) reads later tokens, and is refused at the op that let it in (a convolution padded on
both sides, a slice that starts at a later token), naming it. Stride > 1 along the sequence and
pads other than constant ones are refused too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from torch._guards import detect_fake_mode

from tpc.compiler.frontend import runtime_ops
from tpc.compiler.frontend.analyse import mixing_reason
from tpc.compiler.frontend.axes import node_token_axes, size_expr
from tpc.compiler.frontend.calls import call_args, op_name
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import evaluate, prune_dead
from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten

_PADS = {aten.pad.default, aten.constant_pad_nd.default}
_CONVS = {aten.conv1d.default, aten.conv1d.padding, aten.convolution.default,
          aten.conv2d.default, aten.conv2d.padding, aten.conv3d.default, aten.conv3d.padding}
_INT64_MAX = 2**63 - 1
WINDOW_KIND = "causal-window"  # node.meta["tpc_kind"] of the ops this pass checked


@dataclass
class StateSite:
    """The last `window - 1` tokens of `x` (token axis `dim`), carried from slice to slice."""

    node: fx.Node  # the first causal_pad reading them (its unit holds the cache)
    x: fx.Node
    prefix: fx.Node  # placeholder: the carried tokens
    dim: int
    window: int
    per_slice = False  # (CacheSite) its cached tensor holds tokens

    @property
    def cached(self) -> list[tuple]:
        return [(self.x, self.prefix, self.dim, self.window)]


def _refuse(node, ctx, message, hint):
    raise refuse(node, ctx.model_file, message, hint)


_HINT = ("a causal convolution or shift pads the sequence on the left only (F.pad(x, (k - 1, 0)), "
         "nn.ZeroPad2d((0, 0, 1, -1)), or Conv1d(padding=k - 1) followed by [..., :T]); token slices "
         "carry its last k - 1 input tokens from slice to slice")


def _axis(n, ctx) -> int | None:
    """The one token axis of a tensor value, or None."""
    if not isinstance(n, fx.Node):
        return None
    axes = node_token_axes(n, ctx.seq_sym)
    return axes[0] if len(axes) == 1 else None


def _extra(n: fx.Node, ctx) -> int | None:
    """a: the value's length along its token axis minus the sequence length, when an integer."""
    d = _axis(n, ctx)
    if d is None:
        return None
    a = size_expr(n.meta["val"].shape[d]) - ctx.seq_sym  # T + 2 - T: sympy cancels it to 2
    return int(a) if a.is_Integer else None


def fake_like(like: torch.Tensor, shape) -> torch.Tensor:
    """A fake value of `shape` (SymInt arithmetic on the capture's sizes) like `like`. Made
    without running the op on the fake inputs: evaluating its shape checks would specialise the
    capture's symbolic sizes to the example's."""
    mode = detect_fake_mode([like])
    with mode, mode.shape_env.suppress_guards():
        return like.new_empty(tuple(shape))


def _padded(x: fx.Node, pad: list) -> torch.Tensor:
    v = x.meta["val"]
    shape = list(v.shape)
    for i in range(len(pad) // 2):
        shape[v.dim() - 1 - i] = shape[v.dim() - 1 - i] + pad[2 * i] + pad[2 * i + 1]
    return fake_like(v, shape)


def _new(graph, before: fx.Node, target, args, val: torch.Tensor, like: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        n = graph.call_function(target, args)
    n.meta = {k: v for k, v in like.meta.items() if k not in ("val", "tpc_kind")}
    n.meta["val"] = val
    return n


# ------------------------------------------------------------------ normal forms: a pad first

def _pad_of(n: fx.Node, ctx):
    """(input, token axis, left, right, value) of a constant pad along the token axis, or None."""
    if n.op != "call_function" or n.target not in _PADS:
        return None
    a = call_args(n)
    x, pad = a["self"], list(a["pad"])
    d = _axis(x, ctx)
    if d is None or n in ctx.static:
        return None
    rank = x.meta["val"].dim()
    i = rank - 1 - d  # pad pairs run from the last dim backwards
    if 2 * i + 1 >= len(pad):
        return None
    if a.get("mode", "constant") != "constant":
        _refuse(n, ctx, f"a `{a['mode']}` pad along the sequence (node {n.name}): the padding reads the "
                        "sequence's own tokens, which a token slice does not have", _HINT)
    value = a.get("value") if n.target is aten.pad.default else a.get("value", 0)
    return x, d, pad[2 * i], pad[2 * i + 1], 0.0 if value is None else value


def _conv_of(n: fx.Node, ctx):
    """(input, index of the token axis among the spatial dims, kernel, stride, padding, dilation)
    of a convolution along the sequence, or None."""
    if n.op != "call_function" or n.target not in _CONVS:
        return None
    a = call_args(n)
    x, w = a["input"], a["weight"]
    d = _axis(x, ctx)
    if d is None or n in ctx.static:
        return None
    spatial = w.meta["val"].dim() - 2
    rank = x.meta["val"].dim()
    j = d - (rank - spatial)
    if j < 0:
        return None  # the token axis is a batch or channel axis: the convolution is per token
    if n.target is aten.convolution.default and a["transposed"]:
        _refuse(n, ctx, f"a transposed convolution along the sequence (node {n.name})", _HINT)
    if spatial != 1:
        _refuse(n, ctx, f"a {spatial}-d convolution over the sequence (node {n.name})",
                "token slices support 1-d convolutions along the sequence (Conv1d), padded on the left")
    kernel = int(size_expr(w.meta["val"].shape[-1]))
    pick = lambda v: int(v[0] if isinstance(v, (list, tuple)) else v)  # noqa: E731
    return x, kernel, pick(a["stride"]), a["padding"], pick(a["dilation"])


def _normalise(graph: fx.Graph, ctx) -> None:
    for n in list(graph.nodes):
        conv = _conv_of(n, ctx)
        if conv is not None:
            _conv_padding_to_pad(graph, n, conv, ctx)
        elif n.op == "call_function" and n.target is aten.cat.default and n not in ctx.static:
            _cat_to_pad(graph, n, ctx)
    for n in list(graph.nodes):
        found = _pad_of(n, ctx)
        if found is not None:
            _fold_cropping_slice(graph, n, found, ctx)
    prune_dead(graph)


def _conv_padding_to_pad(graph, n, conv, ctx) -> None:
    """conv(x, padding=p) -> conv(pad(x, (p_left, p_right)), padding=0) along the sequence."""
    x, kernel, stride, padding, dilation = conv
    _check_stride(n, stride, ctx)
    if isinstance(padding, str):
        total = dilation * (kernel - 1) if padding == "same" else 0
        left, right = total // 2, total - total // 2
    else:
        p = int(padding[0] if isinstance(padding, (list, tuple)) else padding)
        left = right = p
    if left == 0 and right == 0 and not isinstance(padding, str):
        return
    pad = [left, right]  # the last axis
    padded = _new(graph, n, aten.constant_pad_nd.default, (x, pad, 0.0), _padded(x, pad), n) if left or right else x
    a = call_args(n)
    v = padded.meta["val"]
    val = fake_like(n.meta["val"], (*n.meta["val"].shape[:-1], v.shape[-1] - dilation * (kernel - 1)))
    if n.target is aten.convolution.default:
        args = (padded, a["weight"], a["bias"], a["stride"], [0], a["dilation"], False, a["output_padding"], a["groups"])
        new = _new(graph, n, aten.convolution.default, args, val, n)
    else:
        args = (padded, a["weight"], a["bias"], a["stride"], [0], a["dilation"], a["groups"])
        new = _new(graph, n, aten.conv1d.default, args, val, n)
    n.replace_all_uses_with(new)
    graph.erase_node(n)


_FILLS = {aten.zeros_like.default: 0, aten.new_zeros.default: 0, aten.zeros.default: 0,
          aten.ones_like.default: 1, aten.new_ones.default: 1, aten.ones.default: 1}


def _fill(const: fx.Node, ctx):
    """The one value every element of `const` holds (a zeros_like, a full, a static constant
    block), or None."""
    if const.target in _FILLS:
        return _FILLS[const.target]
    if const.target in (aten.full_like.default, aten.new_full.default, aten.full.default):
        value = const.args[1]
        return value if isinstance(value, (int, float)) else None
    if const not in ctx.static:
        return None
    try:
        flat = evaluate(const, {ctx.seq_sym: ctx.seq_len, ctx.batch_sym: 2}, ctx.fetch).flatten()
    except Exception:
        return None
    return flat[0].item() if flat.numel() and bool((flat == flat[0]).all()) else None


def _check_stride(n, stride, ctx) -> None:
    if stride != 1:
        _refuse(n, ctx, f"a convolution along the sequence with stride {stride} (node {n.name}): its "
                        "output has fewer tokens than its input", _HINT)


def _cat_to_pad(graph, n, ctx) -> None:
    """cat([c, x], d) with c a constant block of p tokens -> pad(x, (p, 0), value c) (and after)."""
    parts, dim = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return
    out_axis = _axis(n, ctx)
    if out_axis is None or dim % n.meta["val"].dim() != out_axis:
        return
    for const, x, first in ((parts[0], parts[1], True), (parts[1], parts[0], False)):
        if not (isinstance(const, fx.Node) and isinstance(x, fx.Node) and x not in ctx.static
                and _axis(x, ctx) == out_axis and isinstance(const.meta.get("val"), torch.Tensor)):
            continue
        width = size_expr(const.meta["val"].shape[out_axis])
        value = _fill(const, ctx) if width.is_Integer else None
        if value is None:
            continue
        p = int(width)
        pad = [0, 0] * (x.meta["val"].dim() - 1 - out_axis) + ([p, 0] if first else [0, p])
        new = _new(graph, n, aten.constant_pad_nd.default, (x, pad, value), _padded(x, pad), n)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        return


def _fold_cropping_slice(graph, n, found, ctx) -> None:
    """pad(x[..., :T - q], (p, r)) along the sequence -> pad(x, (p, r - q)): the token shift
    written as a slice, then a pad."""
    s, d, left, right, value = found
    if left <= 0 or s.target is not aten.slice.Tensor:
        return
    a = dict(zip(["self", "dim", "start", "end", "step"], s.args))
    a.update(s.kwargs)
    x = a["self"]
    if _axis(x, ctx) is None or a.get("dim", 0) % x.meta["val"].dim() != _axis(x, ctx) or \
            a.get("start") not in (None, 0) or a.get("step", 1) not in (None, 1):
        return
    q = _extra(x, ctx) - _extra(s, ctx) if _extra(x, ctx) is not None and _extra(s, ctx) is not None else None
    if q is None or q <= 0:
        return
    rank = x.meta["val"].dim()
    pad = [0, 0] * (rank - 1 - _axis(x, ctx)) + [left, right - q]
    new = _new(graph, n, aten.constant_pad_nd.default, (x, pad, value), _padded(x, pad), n)
    n.replace_all_uses_with(new)
    graph.erase_node(n)


# ------------------------------------------------------------------ following the windows

@dataclass
class _Window:
    a: int  # length along the token axis minus the sequence length
    e: int  # entries [0, l + e) of the slice's value are the unsliced value's [offset, offset + l + e)
    culprit: fx.Node | None = None  # where entries that read later tokens came in (e < a)

    @property
    def clean(self) -> bool:
        return self.e >= self.a


def _entry(pad: _Window, p: int, r: int) -> _Window:
    a = pad.a + p + r
    return _Window(a, min(pad.e + p, a))


def _follow(graph: fx.Graph, ctx) -> list[tuple]:
    """Check every data value's window; returns the pads that start a causal window:
    [(pad node, x, token axis, left, right, value)]."""
    win: dict[fx.Node, _Window] = {}
    entries = []

    def of(x) -> _Window:
        return win.get(x, _Window(0, 0)) if isinstance(x, fx.Node) else _Window(0, 0)

    for n in graph.nodes:
        if n.op == "placeholder":
            win[n] = _Window(0, 0)
            continue
        if n.op == "output":
            outs = []
            fx.node.map_arg(n.args[0], outs.append)
            for x in outs:
                _sink(x, of(x), ctx, "the model's output")
            continue
        if n.op != "call_function" or n in ctx.static:
            continue
        ins = [a for a in n.all_input_nodes if a in win]
        if not ins:
            continue
        if n.target is runtime_ops.causal_attention:
            for x, what in zip(n.args[:3], ("queries", "keys", "values")):
                _sink(x, of(x), ctx, f"the attention's {what}")
            win[n] = _Window(0, 0)
            continue
        w = _step(n, ins, of, ctx, entries)
        if w is not None:
            win[n] = w
    return entries


def _sink(x: fx.Node, w: _Window, ctx, what: str) -> None:
    if w.clean:
        return
    culprit = w.culprit or x
    _refuse(culprit, ctx,
            f"`{op_name(culprit)}` (node {culprit.name}) is not causal: through it, {what} at token t "
            f"depends on up to {w.a - w.e} later token(s), which a token slice does not have yet", _HINT)


def _step(n: fx.Node, ins, of, ctx, entries) -> _Window | None:
    """The window of `n` from its inputs'; None for values without one token axis."""
    first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else ins[0]
    w_in = of(first)
    pad = _pad_of(n, ctx)
    if pad is not None:
        x, d, left, right, value = pad
        n.meta["tpc_kind"] = WINDOW_KIND
        if left > 0:
            _sink(x, w_in, ctx, "the value padded along the sequence")
            if w_in.a != 0:
                _refuse(n, ctx, f"a pad along the sequence (node {n.name}) of a value that is not aligned "
                                f"with the tokens ({w_in.a:+d} entries)", _HINT)
            entries.append((n, x, d, left, right, value))
            return _culprit(_entry(w_in, left, right), n)
        a = w_in.a + left + right
        return _culprit(_Window(a, min(w_in.e + left, a)), n)
    conv = _conv_of(n, ctx)
    if conv is not None:
        x, kernel, stride, padding, dilation = conv
        _check_stride(n, stride, ctx)
        span = dilation * (kernel - 1)
        n.meta["tpc_kind"] = WINDOW_KIND
        return _culprit(_Window(w_in.a - span, w_in.e - span), n)
    if n.target is aten.unfold.default and _axis(first, ctx) is not None and \
            n.args[1] % first.meta["val"].dim() == _axis(first, ctx):
        size, step = n.args[2], n.args[3]
        if step != 1:
            _refuse(n, ctx, f"`unfold` along the sequence with step {step} (node {n.name})", _HINT)
        n.meta["tpc_kind"] = WINDOW_KIND
        return _culprit(_Window(w_in.a - (size - 1), w_in.e - (size - 1)), n)
    if n.target is aten.slice.Tensor and _axis(first, ctx) is not None and \
            (n.args[1] if len(n.args) > 1 else 0) % first.meta["val"].dim() == _axis(first, ctx):
        a = dict(zip(["self", "dim", "start", "end", "step"], n.args))
        start, step = a.get("start") or 0, a.get("step", 1) or 1
        if not isinstance(start, int) or start < 0 or step != 1:
            return None  # from the end, or strided: a token-mixing slice (refused by analyse.py)
        out = _extra(n, ctx)
        if out is None:
            return None
        n.meta["tpc_kind"] = WINDOW_KIND
        return _culprit(_Window(out, min(w_in.e - start, out)), n)
    if mixing_reason(n, ctx.seq_sym) is not None:
        return None  # refused by the token-mixing rules (analyse.py) with their own message
    outs = [n] if isinstance(n.meta.get("val"), torch.Tensor) else []
    if not outs:  # a tuple (chunk, split) or a size: its items are taken by getitem
        return _Window(w_in.a, w_in.e, w_in.culprit)
    if _axis(n, ctx) is None:
        return None
    a = _extra(n, ctx)
    # inputs along the sequence (a tuple of them: chunk, split)
    tracked = [of(x) for x in ins if _axis(x, ctx) is not None or not isinstance(x.meta.get("val"), torch.Tensor)]
    if a is None and _merged(n, ctx) and all(w.a == 0 and w.clean for w in tracked):
        return _Window(0, 0)  # tokens merged with another axis ((B * T, C) in GPT-2's Conv1D), all aligned
    if a is None or any(w.a != a for w in tracked):
        _refuse(n, ctx, f"`{op_name(n)}` (node {n.name}) changes the length of the sequence axis in a way "
                        "token slices cannot follow", _HINT)
    e = min((w.e for w in tracked), default=0)
    bad = next((w.culprit for w in tracked if not w.clean), None)
    return _Window(a, min(e, a), bad)


def _merged(n: fx.Node, ctx) -> bool:
    """The token axis of `n` is the sequence times other sizes (B * T)."""
    size = size_expr(n.meta["val"].shape[_axis(n, ctx)])
    return ctx.seq_sym not in (size / ctx.seq_sym).free_symbols


def _culprit(w: _Window, n: fx.Node) -> _Window:
    """A window op's result: where its entries that read later tokens come from (itself when
    it adds them, or makes more of them)."""
    if not w.clean:
        w.culprit = n
    return w


# ------------------------------------------------------------------ the rewrite

class CarryCausalState:
    """Every pad that starts a causal window reads the last tokens of the slices before from a
    carried prefix (the module docstring); the state sites join the context."""

    name = "causal-state"

    def run(self, ctx: PassContext) -> PassContext:
        return replace(ctx, states=tuple(carry_causal_state(ctx)))


def carry_causal_state(ctx: PassContext) -> list[StateSite]:
    """Rewrite every pad of `ctx.graph` that starts a causal window into `runtime_ops.causal_pad` over a
    carried prefix; returns the state sites in graph order."""
    graph = ctx.graph
    _normalise(graph, ctx)
    entries = _follow(graph, ctx)
    sites: dict[fx.Node, StateSite] = {}
    anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=list(graph.nodes).index)
    for pad, x, d, left, right, value in entries:
        site = sites.get(x)
        if site is None:
            with graph.inserting_after(anchor):
                prefix = graph.placeholder(f"state_prefix_{len(sites)}")
            prefix.meta["val"] = x.meta["val"]
            anchor = prefix
            site = sites[x] = StateSite(pad, x, prefix, d, left + 1)
        site.window = max(site.window, left + 1)
        with graph.inserting_before(pad):
            new = graph.call_function(runtime_ops.causal_pad, (x, site.prefix, d, left, right, value))
        new.meta = dict(pad.meta)
        new.meta["tpc_kind"] = WINDOW_KIND
        pad.replace_all_uses_with(new)
        graph.erase_node(pad)
        if site.node is pad:
            site.node = new
    prune_dead(graph)
    return list(sites.values())

