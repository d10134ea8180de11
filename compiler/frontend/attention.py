"""Rewrite pass: every causal (or sliding-window) attention becomes a sliced attention with a KV
cache.

Recognised forms (aten level, after capture):
  * `scaled_dot_product_attention(q, k, v, is_causal=True)`, or with an `attn_mask`;
  * the written-out form: `matmul(q, transpose(k))` (or `bmm`, or BLOOM's
    `baddbmm(alibi, q, k^T)`), then any of a scale (`* s`, `/ s`), additive masks and position
    biases (`+ mask`, Hugging Face's eager attention; `+ alibi`), `masked_fill(mask, -inf)`
    (nanoGPT), dtype casts and reshapes of the dims before (query, key), `softmax(-1)`, casts,
    [dropout], [such reshapes], `matmul(., v)`;
  * grouped-query attention whose k/v heads are repeated after the projection, with
    `repeat_interleave(rep, dim=1)` or as Hugging Face's `repeat_kv` (`x[:, :, None]
    .expand(b, h, rep, t, d).reshape(b, h * rep, t, d)`): the cache holds the un-repeated heads
    (rep times smaller) and the repeat runs after the cache.

The masks are read exactly (`masks.py`): each is evaluated at the compile's full sequence length
and must be causal or banded (a sliding window); anything else is refused, saying what the mask
is. The finite part of an additive mask is a position bias (ALiBi), kept as a table its slices
are rebuilt from (`bias.py`). Each attention becomes
`runtime_ops.causal_attention(q, k, v, k_prefix, v_prefix, ..., window=w, bias=table, offset=offset)`:
k_prefix/v_prefix are new graph placeholders; k and v (this slice's) are recorded as the site's
cached values, which the stage graph returns so their gradients can flow back from later
slices.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch
import torch.fx as fx

from tpc.compiler.frontend import bias, masks, runtime_ops
from tpc.compiler.frontend.axes import node_token_axes, size_expr
from tpc.compiler.frontend.calls import call_args
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import evaluate, prune_dead
from tpc.compiler.frontend.source_locations import refuse

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
    per_slice = False  # (CacheSite) its cached tensors hold tokens

    @property
    def cached(self) -> list[tuple]:
        """(value, prefix placeholder, token axis, window) of each tensor the site caches."""
        return [(self.k, self.k_prefix, self.kv_dims[0], self.window),
                (self.v, self.v_prefix, self.kv_dims[1], self.window)]


@dataclass
class _Term:
    """A mask (or position bias) applied to the scores."""

    node: fx.Node
    how: str  # "keep" | "hide" | "add" (masks.py)
    factor: float = 1.0  # scales applied to the scores after it was added (a bias is scaled too)
    lead: tuple = ()  # size expressions of the scores' dims before (query, key) where it is applied


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
    masks: list = field(default_factory=list)  # _Term
    at: fx.Node | None = None  # the node a refusal points at (the SDPA call, or the softmax)
    lead: tuple = ()  # size expressions of the dims before (query, key) of q's own scores
    softcap: float | None = None  # scores = softcap * tanh(scale * q.k^T) (Gemma 2), then masks
    sink: fx.Node | None = None  # a logit per head joined as one more key column (GPT-OSS)


def _refuse(node, ctx, message, hint):
    raise refuse(node, ctx.model_file, message, hint)


def _match_sdpa(n: fx.Node, ctx) -> _Match | None:
    if n.target is not aten.scaled_dot_product_attention.default:
        return None
    a = call_args(n)
    lead = _lead(a["query"])
    found = _Match(n, a["query"], a["key"], a["value"], a.get("scale"), float(a.get("dropout_p") or 0.0),
                   bool(a.get("enable_gqa")), bool(a.get("is_causal")), at=n, lead=lead)
    if a.get("attn_mask") is not None:
        found.masks.append(_Term(a["attn_mask"], "keep", 1.0, lead))
    return found


def _lead(x: fx.Node) -> tuple:
    """Size expressions of the dims of x before its last two."""
    return tuple(size_expr(d) for d in x.meta["val"].shape[:-2])


def _lead_reshape(x: fx.Node) -> fx.Node | None:
    """x's input, when x only regroups the dims before the last two (BLOOM views its scores
    (B * H, q, k) as (B, H, q, k) and back)."""
    if x.op != "call_function" or x.target not in _RESHAPES or not isinstance(x.args[0], fx.Node):
        return None
    a, b = x.args[0].meta.get("val"), x.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
        return None
    same = [size_expr(d) for d in a.shape[-2:]] == [size_expr(d) for d in b.shape[-2:]]
    return x.args[0] if same else None


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


_SOFTMAX = {aten.softmax.int, aten._softmax.default, getattr(aten, "_safe_softmax", aten.softmax).default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}
_NEG_INF_FILL = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
# in-place forms act on the fresh score tensor the way the plain ones do
_MUL = {aten.mul.Tensor, aten.mul_.Tensor}
_DIV = {aten.div.Tensor, aten.div_.Tensor}
_ADD = {aten.add.Tensor, aten.add_.Tensor}
_MATMUL = {aten.matmul.default, aten.bmm.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


_TANH = {aten.tanh.default, aten.tanh_.default}
_CLAMPS = {aten.maximum.default, aten.max.other, aten.clamp_min.default, aten.clamp.default}
_SUB = {aten.sub.Tensor, aten.sub_.Tensor}


def _row_max_of(m, x: fx.Node) -> bool:
    """Whether `m` is the maximum of `x` over its last dim, kept (`x.max(-1, keepdim=True).values`,
    `amax(x, -1, keepdim=True)`), detached or not: subtracting it changes no softmax."""
    while isinstance(m, fx.Node) and m.target in (aten.detach.default, aten.alias.default):
        m = m.args[0]
    if not isinstance(m, fx.Node) or m.op != "call_function":
        return False
    rank = x.meta["val"].dim()
    if m.target is operator.getitem and m.args[1] == 0:
        mx = m.args[0]
        return (isinstance(mx, fx.Node) and mx.target is aten.max.dim and mx.args[0] is x
                and mx.args[1] % rank == rank - 1 and bool(call_args(mx).get("keepdim")))
    if m.target is aten.amax.default and m.args[0] is x:
        dims = call_args(m).get("dim")
        return list(dims or []) in ([-1], [rank - 1]) and bool(call_args(m).get("keepdim"))
    return False


def _floor_clamp(x: fx.Node, ctx):
    """The clamped scores when `x` clamps them from below at the dtype's minimum or lower
    (XGLM: `max(scores + mask, finfo.min)`): it changes no finite score and leaves a hidden key
    hidden (its exponential is still zero), so the clamp is dropped. None otherwise."""
    if x.target in (aten.maximum.default, aten.max.other):
        for a, b in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            if isinstance(b, fx.Node) and _hides(b, ctx):
                return a
        return None
    a = call_args(x)
    low = a.get("min")
    if x.target is aten.clamp.default and a.get("max") is not None:
        return None
    return a.get("self") if low is not None and _hides(low, ctx) else None


def _sink_column(x: fx.Node, rank: int):
    """(scores, sink) when x joins one column to the scores along the keys
    (`cat([scores, sinks.expand(B, H, q, 1)], -1)`, GPT-OSS's attention sinks), else None."""
    a = call_args(x)
    parts, dim = a.get("tensors"), a.get("dim", 0)
    if x.target is not aten.cat.default or len(parts or ()) != 2 or dim % rank != rank - 1:
        return None
    scores, sink = parts
    v = sink.meta.get("val") if isinstance(sink, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != rank or v.shape[-1] != 1:
        return None
    return scores, sink


def _reads_any(n: fx.Node, targets: set) -> bool:
    """Whether n's value is computed from one of `targets` (their sizes do not count)."""
    seen, stack = set(), [n]
    while stack:
        a = stack.pop()
        if a in targets:
            return True
        if a in seen or (a.op == "call_function" and a.target is aten.sym_size.int):
            continue
        seen.add(a)
        stack.extend(a.all_input_nodes)
    return False


def _drops_last_column(p: fx.Node, src: fx.Node) -> bool:
    """Whether p is `src[..., :-1]`: the probabilities without the sink column."""
    if p is None or p.target is not aten.slice.Tensor or p.args[0] is not src:
        return False
    a = call_args(p)
    rank = src.meta["val"].dim()
    end = a.get("end")
    if a.get("dim", 0) % rank != rank - 1 or (a.get("start") or 0) != 0 or a.get("step", 1) != 1:
        return False
    if end == -1:
        return True
    if end is None or isinstance(end, int):
        return False
    return size_expr(p.meta["val"].shape[-1]) == size_expr(src.meta["val"].shape[-1]) - 1


def _unknown(x: fx.Node, sm: fx.Node, ctx, scores: bool):
    """A softmax over (tokens x tokens) scores that pass through an op the pass cannot read:
    refused here, saying which op (the token-mixing rules would only see a matmul)."""
    if not scores:
        return None
    name = getattr(x.target, "__name__", str(x.target))
    _refuse(x, ctx, f"attention scores pass through `{name}` (node {x.name}) before the softmax: token "
                    "slices support softmax(q.k^T * scale + mask) . v with causal or sliding-window masks",
            "write the attention as scaled_dot_product_attention, or as q @ k^T, a scale, a causal or "
            "sliding-window mask (masked_fill / where with -inf, or an additive mask or position bias such "
            "as ALiBi), softmax, @ v; logit soft-capping `c * tanh(s / c)` and a sink logit per head "
            "joined with `cat` are read too")


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
    """softmax over the keys of matmul(q, k^T) (or BLOOM's baddbmm(bias, q, k^T)), read backwards
    through scales, masks, position biases, casts and reshapes of the dims before (query, key),
    and forwards through casts, dropout and such reshapes to matmul(., v)."""
    if sm.op != "call_function" or sm.target not in _SOFTMAX:
        return None
    rank = sm.meta["val"].dim()
    if sm.args[1] % rank != rank - 1:
        return None
    scale, found_masks, x = 1.0, [], sm.args[0]
    softcap, sink, masks_outside = None, None, 0
    scores = len(node_token_axes(x, ctx.seq_sym)) == 2 if isinstance(x, fx.Node) else False
    while isinstance(x, fx.Node) and x.op == "call_function":
        if x.target in _MATMUL:
            break
        if softcap is not None and len(found_masks) > masks_outside:  # tanh(s + mask): not a mask
            _refuse(prev, ctx, "a mask or position bias added to the attention scores inside their soft-capping "
                            "`tanh`: the capped mask no longer hides a key",
                    "add the mask after the soft-capping, as Gemma 2 does")
        prev = x
        if x.target in _SUB and len(x.args) == 2 and x.kwargs.get("alpha", 1) == 1 and _row_max_of(x.args[1], x.args[0]):
            x = x.args[0]  # minus the row's maximum: the same softmax
            continue
        if x.target in _CLAMPS and _floor_clamp(x, ctx) is not None:
            x = _floor_clamp(x, ctx)
            continue
        if x.target is aten.cat.default:
            found = _sink_column(x, rank)
            if found is None or sink is not None or found_masks or scale != 1.0 or softcap is not None:
                _refuse(x, ctx, f"a column joined onto the attention scores (`cat`, node {x.name}) that is not "
                                "a logit per head (an attention sink) joined before any scale or mask",
                        "join the sink logits (a parameter per head, expanded to (batch, heads, queries, 1)) "
                        "as the scores' last column, drop that column after the softmax (probs[..., :-1])")
            x, sink = found
            joined = prev
            continue
        if x.target in _TANH:
            if softcap is not None:
                return _unknown(x, sm, ctx, scores)
            softcap, scale, masks_outside = scale, 1.0, len(found_masks)  # c * tanh(...): c so far
            x = x.args[0]
            continue
        if x.target is aten.baddbmm.default:  # beta * bias + alpha * (q @ k^T)
            a = call_args(x)
            alpha, beta = _scalar(a.get("alpha", 1), ctx), _scalar(a.get("beta", 1), ctx)
            if alpha is None or beta is None or alpha <= 0:
                return _unknown(x, sm, ctx, scores)
            found_masks.append(_Term(a["self"], "add", scale * beta, _lead(x)))
            scale *= alpha
            break
        if _lead_reshape(x) is not None:
            x = x.args[0]
        elif x.target in _MUL or x.target in _DIV:
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
            term = _added_term(a, b, ctx)
            if term is None:
                return _unknown(x, sm, ctx, scores)
            found_masks.append(_Term(term, "add", scale, _lead(x)))
            x = b if term is a else a
        elif x.target in _NEG_INF_FILL and _hides(x.args[2], ctx):
            found_masks.append(_Term(x.args[1], "hide"))
            x = x.args[0]
        elif x.target in (aten.where.ScalarOther, aten.where.self) and _hides(x.args[2], ctx):
            found_masks.append(_Term(x.args[0], "keep"))
            x = x.args[1]
        elif x.target in (aten.where.ScalarSelf, aten.where.self) and _hides(x.args[1], ctx):
            found_masks.append(_Term(x.args[0], "hide"))
            x = x.args[2]
        elif _is_cast(x):
            x = x.args[0]
        else:
            return _unknown(x, sm, ctx, scores)
    if not (isinstance(x, fx.Node) and x.op == "call_function"):
        return None
    if x.target is aten.baddbmm.default:
        q, kt = call_args(x)["batch1"], call_args(x)["batch2"]
    elif x.target in _MATMUL:
        q, kt = x.args
    else:
        return None
    k = _transposed_last_two(kt) if isinstance(kt, fx.Node) else None
    if k is None:
        return None
    if sink is not None and _reads_any(sink, {x, kt, k}):
        _refuse(joined, ctx, f"a column joined onto the attention scores (`cat`, node {joined.name}) computed "
                             "from the keys or the scores: a token slice does not have the keys it reads",
                "join a logit per head (a parameter) as the sink column, as GPT-OSS does")
    p, dropout_p, p_src = _only_user(sm), 0.0, sm
    if sink is not None:
        if not _drops_last_column(p, sm):
            _refuse(sm, ctx, "attention probabilities over the scores and a sink column, used without dropping "
                             "the sink column (probs[..., :-1])",
                    "drop the sink's column after the softmax, as GPT-OSS does")
        p_src, p = p, _only_user(p)
    while p is not None and (_is_cast(p) or p.target is aten.dropout.default or _lead_reshape(p) is not None):
        if p.target is aten.dropout.default:
            if dropout_p or p.args[0] is not p_src:
                return None
            dropout_p = float(p.args[1]) if p.args[2] else 0.0
        p_src, p = p, _only_user(p)
    if p is None or p.target not in _MATMUL or p.args[0] is not p_src:
        return None
    v = p.args[1]
    want = [size_expr(d) for d in q.meta["val"].shape[:-1]] + [size_expr(v.meta["val"].shape[-1])]
    if [size_expr(d) for d in p.meta["val"].shape] != want:
        return None  # the probabilities were regrouped into another layout than q's
    return _Match(p, q, k, v, scale, dropout_p, masks=found_masks, at=sm, lead=_lead(x), softcap=softcap, sink=sink)


def _added_term(a, b, ctx) -> fx.Node | None:
    """Of `a + b` on the way back from a softmax, the operand added to the scores: a static
    value over (query, key) positions (a mask, a position bias). The other operand is the
    scores, a data value."""
    for term, other in ((b, a), (a, b)):
        if isinstance(term, fx.Node) and term in ctx.static and isinstance(other, fx.Node) \
                and other not in ctx.static and node_token_axes(term, ctx.seq_sym):
            return term
    for term in (b, a):  # a mask computed from the ids: refused when the mask is read
        if isinstance(term, fx.Node) and len(node_token_axes(term, ctx.seq_sym)) == 2:
            return term
    return None


def _ungroup(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node, int]:
    """k/v whose heads are repeated after the projection: cache before the repeat."""
    rk, rv = _repeated(k), _repeated(v)
    if rk and rv and rk[1] == rv[1]:
        return rk[0], rv[0], rk[1]
    return k, v, 1


def _repeated(x: fx.Node):
    """(un-repeated value, rep) when x repeats each head of a (B, H, T, D) value rep times."""
    if x.target is aten.repeat_interleave.self_int:
        a = call_args(x)
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


def _pattern(m: _Match, ctx: PassContext, readings: dict) -> tuple[masks.Pattern, list]:
    """The mask of a matched attention, read at the plan's length, and the position biases
    among its terms ([(term, reading)]); refused unless the mask is causal or banded.
    `readings`: the masks read so far ((node, how) -> masks.Reading), shared by the attentions."""
    n = ctx.seq_len
    if m.is_causal and not m.masks:
        return masks.Pattern("causal"), []
    keep = torch.ones(n, n, dtype=torch.bool).tril() if m.is_causal else None
    biases = []
    for term in m.masks:
        reading = _read(term, m, ctx, readings)
        keep = masks.both(keep, reading.keep)
        if reading.bias is not None:
            biases.append((term, reading))
    if keep is None:
        _refuse(m.at, ctx, "bidirectional attention (no causal mask: every query sees every key, "
                           "including later tokens)",
                "pass is_causal=True (or a causal mask) for a causal language model; a bidirectional "
                "encoder cannot be pipelined over token slices")
    found = masks.classify(keep)
    if found is not None and found.kind == "chunked" and biases:
        _refuse(m.at, ctx, "chunked local attention with a position bias",
                "token slicing supports chunked attention with masks only, position biases with causal or "
                "sliding-window masks")
    if found is None:
        what = masks.describe(keep)
        bidir = what.startswith("bidirectional")
        _refuse(m.at, ctx, f"attention whose mask at the plan's length {n} is {what}"
                           + ("" if bidir else "; token slices support causal, sliding-window and chunked masks only"),
                "a causal language model's attention (is_causal=True, a lower-triangular mask, or a "
                "sliding window) can be sliced by tokens; this mask cannot be"
                + (" (a bidirectional encoder cannot be pipelined over token slices)" if bidir else ""))
    return found, [(t, r, keep) for t, r in biases]


def _read(term: _Term, m: _Match, ctx: PassContext, readings: dict) -> masks.Reading:
    node, how = term.node, term.how
    if not isinstance(node, fx.Node):
        raise masks.NotAMask("a constant mask")  # pragma: no cover - SDPA takes tensors
    if node not in ctx.static:
        _refuse(m.at, ctx, "the attention mask depends on the token ids (a padding or document mask "
                           "computed from the data)",
                "token slicing needs a mask that depends on positions only (causal or a sliding window); for "
                "packed documents leave the mask out of the model and compile with --documents eos:ID "
                "(docs/training.md, 'Packed documents')")
    key = (node, how)
    if key not in readings:
        try:
            value = evaluate(node, {ctx.seq_sym: ctx.seq_len, ctx.batch_sym: 2}, ctx.fetch)
            readings[key] = masks.read(value, how, ctx.seq_len)
        except masks.NotAMask as e:
            _refuse(m.at, ctx, f"the attention's mask cannot be read as a mask: {e}",
                    "token slicing supports causal and sliding-window masks (0 / -inf or True / False) "
                    "and position biases that are the same for every sequence")
        except Exception as e:  # evaluating the model's own code failed
            _refuse(m.at, ctx, f"the attention's mask could not be evaluated at length {ctx.seq_len}: "
                               f"{type(e).__name__}: {e}",
                    "build the mask from sizes and positions only")
    return readings[key]


def _bias_table(m: _Match, biases: list, ctx) -> tuple[torch.Tensor, str]:
    """The table of the summed position biases of an attention and its kind (`bias.py`), in the
    layout of q's scores at batch 1."""
    L = ctx.seq_len

    def at(exprs, batch):
        return tuple(int(e.subs({ctx.batch_sym: batch, ctx.seq_sym: L})) for e in exprs)

    total, keep = None, None
    for term, reading, keep in biases:
        if not _param_free(term.node, ctx):
            _refuse(m.at, ctx, "an attention bias computed from parameters (a learned position bias): "
                               "token slices rebuild a bias from its values at the plan's length, which "
                               "would carry no gradient",
                    "token slicing supports position biases computed from positions and constants (ALiBi)")
        try:
            one = masks.read(evaluate(term.node, {ctx.seq_sym: L, ctx.batch_sym: 1}, ctx.fetch), term.how, L).bias
            one = bias.in_scores_layout(one if one is not None else torch.zeros(()), at(term.lead, 1),
                                        at(m.lead, 1)) * term.factor
            if any(ctx.batch_sym in size_expr(d).free_symbols for d in term.node.meta["val"].shape):
                two = bias.in_scores_layout(reading.bias, at(term.lead, 2), at(m.lead, 2)) * term.factor
                bias.batch_tiles(one, two)
        except (bias.NotABias, RuntimeError) as e:
            _refuse(m.at, ctx, f"the attention's position bias cannot be rebuilt for a token slice: {e}",
                    "token slicing supports position biases that are the same for every sequence of the batch")
        total = one if total is None else total + one
    return bias.table_of(total, keep)


class SliceAttention:
    """Every causal or sliding-window attention becomes `runtime_ops.causal_attention` over a KV cache
    (the module docstring); the sites and the position-bias tables join the context."""

    name = "attention"

    def run(self, ctx: PassContext) -> PassContext:
        sites, tables = rewrite_attention(ctx)
        return replace(ctx, attention=tuple(sites), constants=MappingProxyType({**ctx.constants, **tables}))


def rewrite_attention(ctx: PassContext) -> tuple[list[AttentionSite], dict[str, torch.Tensor]]:
    """Replace each recognised attention of `ctx.graph`; returns the sites in graph order and
    the position-bias tables the rewritten graph reads (`get_attr` name -> table)."""
    graph = ctx.graph
    matches, readings = [], {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        m = _match_sdpa(n, ctx) or _match_written_out(n, ctx)
        if m is not None:
            matches.append((m, *_pattern(m, ctx, readings)))
    anchor = ctx.ids
    sites: list[AttentionSite] = []
    tables: dict[str, torch.Tensor] = {}
    for i, (m, pattern, biases) in enumerate(matches):
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
        # the tokens a later slice may read back: a window's last w - 1, a chunk's up to c - 1
        window = pattern.window if pattern.kind in ("banded", "chunked") else None
        kwargs = {"scale": m.scale, "dropout_p": m.dropout_p, "rep": rep, "enable_gqa": m.enable_gqa}
        if pattern.kind == "banded":
            kwargs["window"] = window
        elif pattern.kind == "chunked":
            kwargs.update(chunk=window, offset=ctx.offset)
        if m.softcap is not None:
            kwargs["softcap"] = m.softcap
        if m.sink is not None:
            kwargs["sink"] = m.sink
        if biases:
            table, kind = _bias_table(m, biases, ctx)
            name = f"tpc_position_bias_{len(ctx.constants) + len(tables)}"
            tables[name] = table
            with graph.inserting_before(m.last):
                node = graph.get_attr(name)
            node.meta["val"] = table
            kwargs.update(bias=node, bias_kind=kind, offset=ctx.offset)
        with graph.inserting_before(m.last):
            att = graph.call_function(runtime_ops.causal_attention, (m.q, k, v, kp, vp), kwargs)
        att.meta = dict(m.last.meta)
        att.meta["tpc_kind"] = "attention"
        m.last.replace_all_uses_with(att)
        graph.erase_node(m.last)
        d = k.meta["val"].dim() - 2
        sites.append(AttentionSite(att, k, v, kp, vp, (d, v.meta["val"].dim() - 2), window))
    prune_dead(graph)
    return sites, tables

