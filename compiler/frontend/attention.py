"""Rewrite pass: every causal (or sliding-window) attention becomes a sliced attention with a KV
cache.

Recognised forms (aten level, after capture):
  * `scaled_dot_product_attention(q, k, v, is_causal=True)`, or with an `attn_mask`;
  * the written-out form: `matmul(q, transpose(k))`, then any of a scale (`* s`, `/ s`), additive
    masks (`+ mask`, Hugging Face's eager attention), `masked_fill(mask, -inf)` (nanoGPT) and
    dtype casts, `softmax(-1)`, casts, [dropout], `matmul(., v)`;
  * grouped-query attention whose k/v heads are repeated after the projection, with
    `repeat_interleave(rep, dim=1)` or as Hugging Face's `repeat_kv` (`x[:, :, None]
    .expand(b, h, rep, t, d).reshape(b, h * rep, t, d)`): the cache holds the un-repeated heads
    (rep times smaller) and the repeat runs after the cache.

The masks are read exactly (`masks.py`): each is evaluated at the compile's full sequence length
and must be causal or banded (a sliding window); anything else is refused, saying what the mask
is. Each attention becomes `ops.causal_attention(q, k, v, k_prefix, v_prefix, ..., window=w)`:
k_prefix/v_prefix are new graph placeholders; k and v (this slice's) are recorded as the site's
cached values, which the stage graph returns so their gradients can flow back from later
slices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tpc.compiler.frontend import masks, ops
from tpc.compiler.frontend.axes import node_token_axes, size_expr
from tpc.compiler.frontend.locate import refuse
from tpc.compiler.frontend.static import evaluate, prune_dead

aten = torch.ops.aten


@dataclass
class AttentionSite:
    node: fx.Node  # the causal_attention call
    k: fx.Node  # this slice's cached keys (graph value)
    v: fx.Node
    k_prefix: fx.Node  # placeholders
    v_prefix: fx.Node
    kv_dims: tuple[int, int]  # token axis of k and v
    window: int | None = None  # sliding window: each query sees its last `window` tokens


@dataclass
class _Match:
    last: fx.Node  # node whose uses the attention output replaces
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float | None
    dropout_p: float
    enable_gqa: bool = False
    is_causal: bool = False
    masks: list = field(default_factory=list)  # (mask node, "keep" | "hide" | "add")
    at: fx.Node | None = None  # the node a refusal points at (the SDPA call, or the softmax)


def _args(n: fx.Node) -> dict:
    names = [a.name for a in n.target._schema.arguments]
    out = {a.name: a.default_value for a in n.target._schema.arguments if a.has_default_value()}
    out.update(zip(names, n.args))
    out.update(n.kwargs)
    return out


def _refuse(node, ctx, message, hint):
    raise refuse(node, ctx.model_file, message, hint)


def _match_sdpa(n: fx.Node, ctx) -> _Match | None:
    if n.target is not aten.scaled_dot_product_attention.default:
        return None
    a = _args(n)
    found = _Match(n, a["query"], a["key"], a["value"], a.get("scale"), float(a.get("dropout_p") or 0.0),
                   bool(a.get("enable_gqa")), bool(a.get("is_causal")), at=n)
    if a.get("attn_mask") is not None:
        found.masks.append((a["attn_mask"], "keep"))
    return found


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


_SOFTMAX = {aten.softmax.int, aten._softmax.default, getattr(aten, "_safe_softmax", aten.softmax).default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}
_NEG_INF_FILL = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
# in-place forms act on the fresh score tensor the way the plain ones do
_MUL = {aten.mul.Tensor, aten.mul_.Tensor}
_DIV = {aten.div.Tensor, aten.div_.Tensor}
_ADD = {aten.add.Tensor, aten.add_.Tensor}


def _unknown(x: fx.Node, sm: fx.Node, ctx, scores: bool):
    """A softmax over (tokens x tokens) scores that pass through an op the pass cannot read:
    refused here, saying which op (the token-mixing rules would only see a matmul)."""
    if not scores:
        return None
    name = getattr(x.target, "__name__", str(x.target))
    _refuse(x, ctx, f"attention scores pass through `{name}` (node {x.name}) before the softmax: token "
                    "slices support softmax(q.k^T * scale + mask) . v with causal or sliding-window masks",
            "write the attention as scaled_dot_product_attention, or as q @ k^T, a scale, a causal or "
            "sliding-window mask (masked_fill / where with -inf, or an additive 0 / -inf mask), softmax, @ v "
            "(logit soft-capping and position biases such as ALiBi cannot be sliced)")


def _is_cast(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target not in _CASTS:
        return False
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _hides(value, ctx) -> bool:
    """A fill value that hides a key (its exponential is zero): a number, or a constant 0-d
    tensor (GPT-Neo's torch.tensor(finfo.min))."""
    if isinstance(value, fx.Node):
        value = _constant(value, ctx)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (value == -math.inf or value <= masks.HIDDEN)


def _constant(x: fx.Node, ctx):
    """The value of a 0-d static tensor no parameter feeds, or None."""
    v = x.meta.get("val")
    if x in ctx.static and isinstance(v, torch.Tensor) and v.dim() == 0 and _param_free(x, ctx):
        try:
            return float(evaluate(x, {ctx.seq_sym: ctx.seq_len, ctx.batch_sym: 1}, ctx.fetch))
        except Exception:
            return None
    return None


def _scalar(x, ctx):
    """A constant positive factor: a number, or a 0-d static tensor that no parameter feeds."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node):
        return _constant(x, ctx)
    return None


def _param_free(n: fx.Node, ctx) -> bool:
    seen, stack = set(), [n]
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op == "get_attr" and a.target in ctx.param_names:
            return False
        stack.extend(a.all_input_nodes)
    return True


def _transposed_last_two(kt: fx.Node) -> fx.Node | None:
    """k when kt is k with its last two axes swapped."""
    v = kt.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    r = v.dim()
    if kt.target is aten.transpose.int and {d % r for d in kt.args[1:3]} == {r - 2, r - 1}:
        return kt.args[0]
    if kt.target is aten.permute.default:
        perm = [d % r for d in kt.args[1]]
        if perm == list(range(r - 2)) + [r - 1, r - 2]:
            return kt.args[0]
    return None


def _match_written_out(sm: fx.Node, ctx) -> _Match | None:
    """softmax over the keys of matmul(q, k^T), read backwards through scales, masks and casts,
    and forwards through casts and dropout to matmul(., v)."""
    if sm.op != "call_function" or sm.target not in _SOFTMAX:
        return None
    rank = sm.meta["val"].dim()
    if sm.args[1] % rank != rank - 1:
        return None
    scale, found_masks, x = 1.0, [], sm.args[0]
    scores = len(node_token_axes(x, ctx.seq_sym)) == 2 if isinstance(x, fx.Node) else False
    while isinstance(x, fx.Node) and x.op == "call_function":
        if x.target is aten.matmul.default:
            break
        if x.target in _MUL or x.target in _DIV:
            a, b = x.args[:2]
            s, rest = _scalar(b, ctx), a
            if s is None and x.target in _MUL:
                s, rest = _scalar(a, ctx), b
            if s is None or s <= 0:
                return _unknown(x, sm, ctx, scores)
            scale = scale * s if x.target in _MUL else scale / s
            x = rest
        elif x.target in _ADD and len(x.args) == 2 and x.kwargs.get("alpha", 1) == 1:
            a, b = x.args
            if isinstance(b, fx.Node) and len(node_token_axes(b, ctx.seq_sym)) == 2:
                found_masks.append((b, "add"))
                x = a
            elif isinstance(a, fx.Node) and len(node_token_axes(a, ctx.seq_sym)) == 2:
                found_masks.append((a, "add"))
                x = b
            else:
                return _unknown(x, sm, ctx, scores)
        elif x.target in _NEG_INF_FILL and _hides(x.args[2], ctx):
            found_masks.append((x.args[1], "hide"))
            x = x.args[0]
        elif x.target in (aten.where.ScalarOther, aten.where.self) and _hides(x.args[2], ctx):
            found_masks.append((x.args[0], "keep"))
            x = x.args[1]
        elif x.target in (aten.where.ScalarSelf, aten.where.self) and _hides(x.args[1], ctx):
            found_masks.append((x.args[0], "hide"))
            x = x.args[2]
        elif _is_cast(x):
            x = x.args[0]
        else:
            return _unknown(x, sm, ctx, scores)
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is aten.matmul.default):
        return None
    q, kt = x.args
    k = _transposed_last_two(kt) if isinstance(kt, fx.Node) else None
    if k is None:
        return None
    p, dropout_p, p_src = _only_user(sm), 0.0, sm
    while p is not None and (_is_cast(p) or p.target is aten.dropout.default):
        if p.target is aten.dropout.default:
            if dropout_p or p.args[0] is not p_src:
                return None
            dropout_p = float(p.args[1]) if p.args[2] else 0.0
        p_src, p = p, _only_user(p)
    if p is None or p.target is not aten.matmul.default or p.args[0] is not p_src:
        return None
    return _Match(p, q, k, p.args[1], scale, dropout_p, masks=found_masks, at=sm)


def _ungroup(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node, int]:
    """k/v whose heads are repeated after the projection: cache before the repeat."""
    rk, rv = _repeated(k), _repeated(v)
    if rk and rv and rk[1] == rv[1]:
        return rk[0], rv[0], rk[1]
    return k, v, 1


def _repeated(x: fx.Node):
    """(un-repeated value, rep) when x repeats each head of a (B, H, T, D) value rep times."""
    if x.target is aten.repeat_interleave.self_int:
        a = _args(x)
        if a.get("dim") == 1 and isinstance(a.get("repeats"), int) and a.get("output_size") is None:
            return a["self"], a["repeats"]
        return None
    # repeat_kv: x[:, :, None, :, :].expand(B, H, rep, T, D).reshape(B, H * rep, T, D)
    if x.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    e = x.args[0]
    if not (isinstance(e, fx.Node) and e.target is aten.expand.default):
        return None
    u = e.args[0]
    if not (isinstance(u, fx.Node) and u.target is aten.unsqueeze.default and u.args[1] in (2, -3)):
        return None
    src = u.args[0]
    sv, ev, xv = (n.meta.get("val") for n in (src, e, x))
    if not all(isinstance(t, torch.Tensor) for t in (sv, ev, xv)) or sv.dim() != 4 or ev.dim() != 5:
        return None
    rep = size_expr(ev.shape[2])
    if not rep.is_Integer:
        return None
    want = [size_expr(sv.shape[0]), size_expr(sv.shape[1]) * rep, size_expr(sv.shape[2]), size_expr(sv.shape[3])]
    if [size_expr(d) for d in xv.shape] != want:
        return None
    return src, int(rep)


def _pattern(m: _Match, ctx) -> masks.Pattern:
    """The mask of a matched attention, read at the plan's length; refused unless it is causal
    or banded."""
    n = ctx.seq_len
    if m.is_causal and not m.masks:
        return masks.Pattern("causal")
    keep = torch.ones(n, n, dtype=torch.bool).tril() if m.is_causal else None
    for node, how in m.masks:
        keep = masks.both(keep, _keep_of(node, how, m, ctx))
    if keep is None:
        _refuse(m.at, ctx, "bidirectional attention (no causal mask: every query sees every key, "
                           "including later tokens)",
                "pass is_causal=True (or a causal mask) for a causal language model; a bidirectional "
                "encoder cannot be pipelined over token slices")
    found = masks.classify(keep)
    if found is None:
        what = masks.describe(keep)
        bidir = what.startswith("bidirectional")
        _refuse(m.at, ctx, f"attention whose mask at the plan's length {n} is {what}"
                           + ("" if bidir else "; token slices support causal and sliding-window masks only"),
                "a causal language model's attention (is_causal=True, a lower-triangular mask, or a "
                "sliding window) can be sliced by tokens; this mask cannot be"
                + (" (a bidirectional encoder cannot be pipelined over token slices)" if bidir else ""))
    return found


def _keep_of(node, how: str, m: _Match, ctx) -> torch.Tensor:
    if not isinstance(node, fx.Node):
        raise masks.NotAMask("a constant mask")  # pragma: no cover - SDPA takes tensors
    if node not in ctx.static:
        _refuse(m.at, ctx, "the attention mask depends on the token ids (a padding or document mask "
                           "computed from the data)",
                "token slicing needs a mask that depends on positions only (causal or a sliding window)")
    key = (node, how)
    if key not in ctx.keep_cache:
        try:
            value = evaluate(node, {ctx.seq_sym: ctx.seq_len, ctx.batch_sym: 2}, ctx.fetch)
            ctx.keep_cache[key] = masks.keep_matrix(value, how, ctx.seq_len)
        except masks.NotAMask as e:
            _refuse(m.at, ctx, f"the attention's mask cannot be read as a mask: {e}",
                    "token slicing supports causal and sliding-window masks (0 / -inf or True / False)")
        except Exception as e:  # evaluating the model's own code failed
            _refuse(m.at, ctx, f"the attention's mask could not be evaluated at length {ctx.seq_len}: "
                               f"{type(e).__name__}: {e}",
                    "build the mask from sizes and positions only")
    return ctx.keep_cache[key]


def rewrite_attention(graph: fx.Graph, ctx) -> list[AttentionSite]:
    """Replace each recognised attention; returns the sites in graph order."""
    matches = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        m = _match_sdpa(n, ctx) or _match_written_out(n, ctx)
        if m is not None:
            matches.append((m, _pattern(m, ctx)))
    anchor = ctx.ids
    sites = []
    for i, (m, pattern) in enumerate(matches):
        k, v, rep = _ungroup(m.k, m.v)
        for t, what in ((k, "keys"), (v, "values")):
            axes = node_token_axes(t, ctx.seq_sym)
            if axes != (t.meta["val"].dim() - 2,):
                _refuse(m.at, ctx, f"attention {what} do not have the token axis second to last",
                        "lay q/k/v out as (batch, heads, tokens, head_dim), as scaled_dot_product_attention expects")
        with graph.inserting_after(anchor):
            kp = graph.placeholder(f"k_prefix_{i}")
        with graph.inserting_after(kp):
            vp = graph.placeholder(f"v_prefix_{i}")
        anchor = vp
        kp.meta["val"], vp.meta["val"] = k.meta["val"], v.meta["val"]
        window = pattern.window if pattern.kind == "banded" else None
        kwargs = {"scale": m.scale, "dropout_p": m.dropout_p, "rep": rep, "enable_gqa": m.enable_gqa}
        if window is not None:
            kwargs["window"] = window
        with graph.inserting_before(m.last):
            att = graph.call_function(ops.causal_attention, (m.q, k, v, kp, vp), kwargs)
        att.meta = dict(m.last.meta)
        att.meta["tpc_kind"] = "attention"
        m.last.replace_all_uses_with(att)
        graph.erase_node(m.last)
        d = k.meta["val"].dim() - 2
        sites.append(AttentionSite(att, k, v, kp, vp, (d, v.meta["val"].dim() - 2), window))
    prune_dead(graph)
    graph.lint()
    return sites

