"""Rewrite pass: every causal attention becomes a sliced attention with a KV cache.

Recognised forms (aten level, after capture):
  * `scaled_dot_product_attention(q, k, v, is_causal=True)` (or with a causal mask);
  * nanoGPT's written-out form: `matmul(q, transpose(k)) [* scale]`, `masked_fill(mask, -inf)` with
    a static causal mask, `softmax(-1)`, [dropout], `matmul(., v)`;
  * grouped-query attention whose k/v come from `repeat_interleave(rep, dim=1)`: the cache holds
    the un-repeated heads (rep times smaller) and the repeat runs after the cache.
Each becomes `ops.causal_attention(q, k, v, k_prefix, v_prefix, ...)`: k_prefix/v_prefix are new
graph placeholders; k and v (this slice's) are recorded as the site's cached values, which the
stage graph returns so their gradients can flow back from later slices. An attention that is not
causal is refused: slicing it would silently drop the future tokens it attends to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from tpc.compiler.frontend import ops
from tpc.compiler.frontend.axes import node_token_axes
from tpc.compiler.frontend.locate import loc_of_node, where_of_node
from tpc.compiler.frontend.static import evaluate, prune_dead
from tpc.ir.diagnostics import Diagnostic, TpirError

aten = torch.ops.aten


@dataclass
class AttentionSite:
    node: fx.Node  # the causal_attention call
    k: fx.Node  # this slice's cached keys (graph value)
    v: fx.Node
    k_prefix: fx.Node  # placeholders
    v_prefix: fx.Node
    kv_dims: tuple[int, int]  # token axis of k and v


@dataclass
class _Match:
    last: fx.Node  # node whose uses the attention output replaces
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float | None
    dropout_p: float
    enable_gqa: bool = False


def _args(n: fx.Node) -> dict:
    names = [a.name for a in n.target._schema.arguments]
    out = {a.name: a.default_value for a in n.target._schema.arguments if a.has_default_value()}
    out.update(zip(names, n.args))
    out.update(n.kwargs)
    return out


def _refuse(node, ctx, message, hint):
    loc = loc_of_node(node, ctx.model_file)
    raise TpirError(Diagnostic(message, loc=loc, where="" if loc else where_of_node(node), hint=hint))


def _is_causal_mask(mask: fx.Node, ctx, fill: bool) -> bool:
    """Evaluate a static mask for a small length and compare with the causal pattern.
    fill=True: True marks positions to hide (masked_fill); else True/0.0 marks positions to keep."""
    if mask not in ctx.static:
        return False
    t = 5
    try:
        m = evaluate(mask, {ctx.seq_sym: t, ctx.batch_sym: 1}, ctx.fetch)
    except Exception:
        return False
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or m.shape[-1] != t or m.shape[-2] != t:
        return False
    keep = torch.ones(t, t, dtype=torch.bool).tril()
    if fill:
        got = ~m.bool()
    else:
        got = m if m.dtype == torch.bool else (m == 0)
    return bool((got == keep).all())


def _match_sdpa(n: fx.Node, ctx) -> _Match | None:
    if n.target is not aten.scaled_dot_product_attention.default:
        return None
    a = _args(n)
    if a.get("attn_mask") is not None:
        if a.get("is_causal") or not _is_causal_mask(a["attn_mask"], ctx, fill=False):
            _refuse(n, ctx, "attention with a mask that is not causal cannot be sliced by tokens",
                    "use is_causal=True (or a lower-triangular mask); token slicing needs every query "
                    "to see only earlier keys")
    elif not a.get("is_causal"):
        _refuse(n, ctx, "bidirectional attention (scaled_dot_product_attention without is_causal=True) "
                        "mixes future tokens into every position",
                "pass is_causal=True for a causal language model; a bidirectional encoder cannot be "
                "pipelined over token slices")
    return _Match(n, a["query"], a["key"], a["value"], a.get("scale"), float(a.get("dropout_p") or 0.0),
                  bool(a.get("enable_gqa")))


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _match_written_out(sm: fx.Node, ctx) -> _Match | None:
    if sm.target not in (aten.softmax.int, aten._softmax.default):
        return None
    rank = sm.meta["val"].dim()
    if sm.args[1] not in (-1, rank - 1):
        return None
    mf = sm.args[0]
    if not (isinstance(mf, fx.Node) and mf.target is aten.masked_fill.Scalar and mf.args[2] == -math.inf):
        return None
    if not _is_causal_mask(mf.args[1], ctx, fill=True):
        return None
    scores, scale = mf.args[0], 1.0
    if scores.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(scores.args[1], (int, float)):
        c = float(scores.args[1])
        scale = c if scores.target is aten.mul.Tensor else 1.0 / c
        scores = scores.args[0]
    if scores.target is not aten.matmul.default:
        return None
    q, kt = scores.args
    if not (kt.target is aten.transpose.int and {d % kt.meta["val"].dim() for d in kt.args[1:]}
            == {kt.meta["val"].dim() - 2, kt.meta["val"].dim() - 1}):
        return None
    p, dropout_p = _only_user(sm), 0.0
    if p is not None and p.target is aten.dropout.default:
        dropout_p = float(p.args[1]) if p.args[2] else 0.0
        p_src, p = p, _only_user(p)
    else:
        p_src = sm
    if p is None or p.target is not aten.matmul.default or p.args[0] is not p_src:
        return None
    return _Match(p, q, kt.args[0], p.args[1], scale, dropout_p)


def _ungroup(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node, int]:
    """k/v repeated over heads with repeat_interleave(rep, dim=1): cache before the repeat."""
    def rep_of(x):
        if x.target is aten.repeat_interleave.self_int:
            a = _args(x)
            if a.get("dim") == 1 and isinstance(a.get("repeats"), int) and a.get("output_size") is None:
                return a["self"], a["repeats"]
        return None
    rk, rv = rep_of(k), rep_of(v)
    if rk and rv and rk[1] == rv[1]:
        return rk[0], rv[0], rk[1]
    return k, v, 1


def rewrite_attention(graph: fx.Graph, ctx) -> list[AttentionSite]:
    """Replace each recognised attention; returns the sites in graph order."""
    matches = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        m = _match_sdpa(n, ctx) or _match_written_out(n, ctx)
        if m is not None:
            matches.append(m)
    anchor = ctx.ids
    sites = []
    for i, m in enumerate(matches):
        k, v, rep = _ungroup(m.k, m.v)
        for t, what in ((k, "keys"), (v, "values")):
            axes = node_token_axes(t, ctx.seq_sym)
            if axes != (t.meta["val"].dim() - 2,):
                _refuse(m.last, ctx, f"attention {what} do not have the token axis second to last",
                        "lay q/k/v out as (batch, heads, tokens, head_dim), as scaled_dot_product_attention expects")
        with graph.inserting_after(anchor):
            kp = graph.placeholder(f"k_prefix_{i}")
        with graph.inserting_after(kp):
            vp = graph.placeholder(f"v_prefix_{i}")
        anchor = vp
        kp.meta["val"], vp.meta["val"] = k.meta["val"], v.meta["val"]
        with graph.inserting_before(m.last):
            att = graph.call_function(ops.causal_attention, (m.q, k, v, kp, vp),
                                      {"scale": m.scale, "dropout_p": m.dropout_p, "rep": rep,
                                       "enable_gqa": m.enable_gqa})
        att.meta = dict(m.last.meta)
        att.meta["tpc_kind"] = "attention"
        m.last.replace_all_uses_with(att)
        graph.erase_node(m.last)
        d = k.meta["val"].dim() - 2
        sites.append(AttentionSite(att, k, v, kp, vp, (d, v.meta["val"].dim() - 2)))
    prune_dead(graph)
    graph.lint()
    return sites
