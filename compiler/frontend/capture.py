"""Capture: the model as one aten-level fx graph with a symbolic batch and sequence length.

We use `torch.export` (non-strict) with both axes of the token-id input dynamic. Plain
`torch.fx.symbolic_trace` cannot slice a buffer by the traced length (`self.bias[:, :, :T, :T]`)
nor unpack a traced shape (`x.reshape(*x.shape[:-1], -1, 2)`); export handles both, keeps
`scaled_dot_product_attention` whole, and records every tensor's symbolic shape in
`node.meta["val"]`, which the token-axis analysis reads. The sequence dimension's range starts at
1 so a slice of one token is inside it (export specialises sizes 0/1 only when the example has
them; the example uses the full length).

The graph is copied into a fresh `Graph` without export's runtime guard calls, and every
parameter is named by its canonical name (the first name `named_parameters()` gives it), so a
tied weight has one name however the model reaches it.
"""

from __future__ import annotations

import inspect
import linecache
from contextlib import contextmanager
import operator
from dataclasses import dataclass, replace

import sympy
import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim, export

from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.context import PassContext
from tpc.compiler.frontend.data_independent import prune_dead
from tpc.compiler.frontend.functional import functionalize
from tpc.compiler.frontend.simplify import drop_noops
from tpc.compiler.frontend.source_locations import compact_stack_trace, loc_from_traceback, refuse
from tpc.ir.diagnostics import Diagnostic, TpirError


@dataclass
class Captured:
    gm: fx.GraphModule  # attributes (constants, buffers) as export made them
    graph: fx.Graph  # the cleaned graph: placeholder ids -> output logits
    ids: fx.Node
    batch_sym: sympy.Symbol
    seq_sym: sympy.Symbol
    model_file: str | None
    param_names: dict[str, str]  # get_attr target -> canonical parameter or buffer name
    full_range: bool  # captured for lengths 1..L (else 1..L-1, see capture())


class CheckLogits:
    """The captured model returns one tensor, the logits (batch, seq, vocab), which the loss is
    appended to: its producer joins the context as `logits`; anything else is refused."""

    name = "logits"

    def run(self, ctx: PassContext) -> PassContext:
        return replace(ctx, logits=check_logits(ctx))


def check_logits(ctx: PassContext) -> fx.Node:
    """The node whose value `ctx.graph` returns, when it is (batch, seq, vocab) logits."""
    out = next(n for n in ctx.graph.nodes if n.op == "output")
    vals = out.args[0]
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    producer = vals[0] if vals and isinstance(vals[0], fx.Node) else None
    v = producer.meta.get("val") if producer is not None else None
    ok = (len(vals) == 1 and isinstance(v, torch.Tensor) and v.dim() == 3
          and size_expr(v.shape[0]) == ctx.batch_sym and size_expr(v.shape[1]) == ctx.seq_sym
          and size_expr(v.shape[2]) == ctx.vocab)
    if not ok:
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else f"{len(vals)} values"
        message = f"the model must return logits of shape (batch, seq, vocab={ctx.vocab}); it returns {got}"
        hint = ("forward(ids: (B, T) int64) must return one tensor (B, T, V); compute the loss outside "
                "the model (tpc adds next-token cross-entropy itself)")
        if producer is not None:
            raise refuse(producer, ctx.model_file, message, hint)
        raise TpirError(Diagnostic(message, where=ctx.model_name, hint=hint))
    return producer


def model_file_of(model: nn.Module) -> str | None:
    try:
        return inspect.getsourcefile(type(model))
    except (TypeError, OSError):
        return None


_HINTS = (
    ("data-dependent", "control flow or indexing that depends on tensor VALUES cannot be traced; "
                       "compute it from shapes only, or move it out of forward"),
    ("guard", "the model constrains the sequence length (an assert, an `if T ...`, a reshape to a fixed "
              "size); the front end needs forward to work for every length 1..L"),
    ("Constraints violated", "the model constrains the sequence length (an assert, an `if T ...`, a "
                             "reshape to a fixed size); forward must work for every length 1..L"),
)


def _capture_hint(msg: str) -> str:
    for key, hint in _HINTS:
        if key in msg:
            return hint
    return "make forward(ids) traceable by torch.export: no data-dependent Python control flow, " \
           "no .item(), no asserts on traced sizes"


@contextmanager
def _without_generation_cache(model: nn.Module):
    """Hugging Face models keep a key/value cache for generation (`config.use_cache`, on by
    default). It does not change the logits, but it slices keys by the sliding window
    (`keys[:, :, -window + 1:]`), which makes export guard the sequence length. The trace is
    taken with it off; the model's configuration is restored afterwards."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and getattr(c, "use_cache", None) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def capture(model: nn.Module, seq_len: int, batch: int = 2) -> Captured:
    from tpc.compiler.frontend.ssm_state import known_scans

    with _without_generation_cache(model), _meta_parameters_on_cpu(model), known_scans(model):
        return _capture(model, seq_len, batch)


@contextmanager
def _meta_parameters_on_cpu(model: nn.Module):
    """A model built without weights (`weightless.py`) has its parameters on the meta device and
    its buffers on the CPU; export would refuse an op mixing the two (`freqs_cis * x`). For the
    capture each meta parameter is stood in for by a CPU tensor of its shape that holds one
    element (`expand`: no memory), which export only ever reads the shape of; the meta
    parameters are put back afterwards (the same objects, so ties stay ties)."""
    swapped, stand_ins = [], {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in stand_ins:  # a tie gets one stand-in
                    stand_ins[id(p)] = nn.Parameter(torch.empty((), dtype=p.dtype).expand(p.shape),
                                                    requires_grad=p.requires_grad)
                mod._parameters[name] = stand_ins[id(p)]
                swapped.append((p, mod, name))
    try:
        yield
    finally:
        for p, mod, name in swapped:
            mod._parameters[name] = p


def _capture(model: nn.Module, seq_len: int, batch: int) -> Captured:
    model_file = model_file_of(model)
    try:
        ep, full_range = _export(model, seq_len, batch, top=max(seq_len, 2)), True
    except _SpecialisedLength:
        raise _length_refusal(model, model_file, seq_len) from None
    except _ConstraintViolation:
        # Slicing a buffer of exactly L rows by T makes export guard `T != L`, a guard the graph
        # does not need (buf[:L] is the whole buffer). Capture on [1, L-1]; the graph runs at L
        # unchanged and SlicedModel's self-check then runs the full length to confirm it.
        try:
            ep, full_range = _export(model, seq_len, batch, top=seq_len - 1), False
        except _SpecialisedLength:
            raise _length_refusal(model, model_file, seq_len) from None
        except _ConstraintViolation as e:
            ep, full_range = _export_size_oblivious(model, seq_len, batch, e)
        except Exception as e:
            raise _capture_error(e, model, model_file) from None
    except TpirError:
        raise
    except Exception as e:
        raise _capture_error(e, model, model_file) from None
    gm = ep.module()
    canon = _canonical_names(model, gm)
    graph, ids_node = _clean_copy(gm.graph, canon, gm, model_file)
    drop_noops(graph)
    shape = ids_node.meta["val"].shape
    batch_sym, seq_sym = (_sym(shape[0]), _sym(shape[1]))
    if batch_sym is None or seq_sym is None:
        raise TpirError(Diagnostic("the model specialises the batch or sequence length while tracing",
                                   where=model_file or type(model).__name__,
                                   hint="forward must work for every batch size and sequence length"))
    return Captured(gm, graph, ids_node, batch_sym, seq_sym, model_file, canon, full_range)


@contextmanager
def _full_stack_traces():
    """Record every frame of each node's stack, not only those of `forward` methods (export's
    default), so a refusal finds the line of the construct itself, in the user's helper
    functions or in a library's (`eager_attention_forward`, `masking_utils`)."""
    base = getattr(fx.proxy, "TracerBase", None)
    orig = getattr(base, "_filter_traceback_frames", None)
    if orig is None:  # another torch: keep its default
        yield
        return

    def every_frame(self, summary):
        only = getattr(self, "_record_forward_stack_traces_only", False)
        self._record_forward_stack_traces_only = False
        try:
            return orig(self, summary)
        finally:
            self._record_forward_stack_traces_only = only

    base._filter_traceback_frames = every_frame
    try:
        yield
    finally:
        base._filter_traceback_frames = orig


class _ConstraintViolation(Exception):
    """export specialised the sequence length: the model constrains it."""


class _SpecialisedLength(Exception):
    """export made the sequence length a constant: the model's code runs once per token (a
    Python loop over them) or branches on the length."""


def _length_refusal(model: nn.Module, model_file: str | None, seq_len: int) -> TpirError:
    """The refusal of a model whose code fixes the sequence length, at its loop over the tokens
    when one is found (`token_loops.py`), quoting the plan's length."""
    from tpc.compiler.frontend.source_locations import loc_at
    from tpc.compiler.frontend.token_loops import token_loop

    found = token_loop(model)
    if found is not None:
        text = linecache.getline(*found).strip()
        return TpirError(Diagnostic(
            f"a Python loop over the tokens (`{text}`) runs once per token, so the model cannot be captured "
            f"for every length 1..{seq_len} (--seq-len {seq_len}): a scan written as a loop fixes the "
            "sequence length", loc=loc_at(*found),
            hint="write the scan with tensor operations over the whole sequence (a cumulative or chunked "
                 "scan), or use the model's vectorised path; token slices can then carry its state"))
    return TpirError(Diagnostic(
        f"the model's code fixes the sequence length while it is captured, so it cannot run for every "
        f"length 1..{seq_len} (--seq-len {seq_len}): a loop over the tokens, a branch on the length or a "
        "reshape to a fixed size", where=model_file or type(model).__name__,
        hint="forward must work for every length 1..L with the same code: no Python loop over the tokens, "
             "no `if T ...`, no reshape to a fixed size"))


def _export(model: nn.Module, seq_len: int, batch: int, top: int):
    # The example length stays below the maximum where it can (at T == L a buffer sliced [:T] is
    # taken whole and export would specialise T), and differs from the example batch, since
    # export gives equal example sizes one symbol.
    t_ex = top - 1 if top >= 4 else top
    b_ex = batch if batch != t_ex else batch + 1
    ids = torch.zeros(b_ex, t_ex, dtype=torch.long)
    dyn = ({0: Dim("batch", min=1), 1: Dim("seq", min=1, max=top)},)
    try:
        with _full_stack_traces():
            return export(model, (ids,), dynamic_shapes=dyn, strict=False)
    except Exception as e:
        if "specialized it to be a constant" in str(e) or "Cannot create Dim with inconsistent" in str(e):
            # (the second: torch failing to word the constraints of a length derived from the
            # sequence's by arithmetic it cannot solve, such as padding to a multiple of a chunk)
            raise _SpecialisedLength() from e  # another length cannot help: the code fixes it
        if "Constraints violated" in str(e) and top > 2:
            raise _ConstraintViolation() from e
        raise


def _export_size_oblivious(model: nn.Module, seq_len: int, batch: int, first: _ConstraintViolation):
    """Export again reasoning about sizes "obliviously" (as if every size were at least 2).

    A length derived from the sequence's (`x[:, :-1]`, T - 1 tokens; a pad then `unfold`,
    T + k - 1 - k + 1) makes export guard it away from 0 and 1 (`T - 1 != 1`, `3 <= T`), which
    fails the range 1..L although the ops work for every length. Size-oblivious reasoning
    takes no such guard; the ops run on the actual sizes, and the numeric self-check (whose
    slices include one token) runs the captured graph at the plan's lengths."""
    from torch.fx.experimental import _config as fx_config

    model_file = model_file_of(model)
    try:
        with fx_config.patch(backed_size_oblivious=True):
            try:
                return _export(model, seq_len, batch, top=max(seq_len, 2)), True
            except _ConstraintViolation:
                return _export(model, seq_len, batch, top=seq_len - 1), False
    except Exception:  # report the first failure: the model's own constraint
        raise _capture_error(first.__cause__, model, model_file) from None


def _capture_error(e: BaseException, model: nn.Module, model_file: str | None) -> TpirError:
    loc = loc_from_traceback(e.__traceback__, model_file)
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    detail = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("- ")), "")
    return TpirError(Diagnostic(
        f"cannot capture the model with a symbolic sequence length: {type(e).__name__}: {first} {detail}".strip(),
        loc=loc, where="" if loc else (model_file or type(model).__name__),
        hint=_capture_hint(text)))


def _sym(d):
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        if isinstance(expr, sympy.Symbol):
            return expr
    return None


def _canonical_names(model: nn.Module, gm: fx.GraphModule) -> dict[str, str]:
    """Map each attribute target of the exported module to the model's canonical name for it.

    The exported module mirrors the model's attribute paths; a tied weight is reachable under
    several paths, and the canonical one is the first that `named_parameters()` yields.
    """
    first: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        first.setdefault(id(t), name)
    out = {}
    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        try:
            out[name] = first.get(id(_get(model, name)), name)
        except AttributeError:
            out[name] = name  # a constant export lifted out of forward
    return out


def _get(mod: nn.Module, name: str):
    obj = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


_DROP = {torch.ops.aten._assert_tensor_metadata.default}
_HOP = torch.ops.higher_order


def _region(n: fx.Node, owner: fx.GraphModule):
    """(sub-graph, its operands, detach its outputs?) of a grad-mode or autocast region export
    recorded as one higher-order call, or None for any other node.

    `torch.no_grad()` around code the model runs (a rotary table computed under
    `@torch.no_grad()`, say) becomes `wrap_with_set_grad_enabled(False, submod, *args)`; its
    outputs are then plain values that carry no gradient, which inlining the region keeps by
    detaching them. A region that disables autocast runs as written in float32."""
    if n.op != "call_function":
        return None
    if n.target is getattr(_HOP, "wrap_with_set_grad_enabled", None):
        enabled, sub, *operands = n.args
        return _submodule(owner, sub), operands, not enabled
    if n.target is getattr(_HOP, "wrap_with_autocast", None):
        device, dtype, enabled, cache, sub, *operands = n.args
        if enabled:
            return None
        return _submodule(owner, sub), operands, False
    return None


def _submodule(owner: fx.GraphModule, sub) -> fx.GraphModule:
    obj = owner
    for part in (sub.target if isinstance(sub, fx.Node) else sub).split("."):
        obj = getattr(obj, part)
    return obj


def _clean_copy(src: fx.Graph, canon: dict[str, str], owner: fx.GraphModule | None = None,
                model_file: str | None = None) -> tuple[fx.Graph, fx.Node]:
    """Copy without export's guard module call and metadata asserts; canonical attribute names;
    grad-mode regions inlined (their results detached where the region disabled gradients);
    in-place writes into tensors the forward makes turned into values (`functional.py`)."""
    g = fx.Graph()
    env: dict[fx.Node, object] = {}
    ids = None

    def inline(sub: fx.GraphModule, operands, detach: bool):
        inner: dict[fx.Node, object] = {}
        args = iter(operands)
        for m in sub.graph.nodes:
            if m.op == "placeholder":
                inner[m] = fx.node.map_arg(next(args), lambda a: env[a])
            elif m.op == "output":
                outs = m.args[0]
                outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                res = []
                for o in outs:
                    o = inner[o] if isinstance(o, fx.Node) else o
                    if detach and isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                        d = g.call_function(torch.ops.aten.detach.default, (o,))
                        d.meta = dict(o.meta)
                        o = d
                    res.append(o)
                return res
            elif m.op == "call_module" or (m.op == "call_function" and m.target in _DROP):
                continue
            elif m.op == "get_attr":
                new = g.get_attr(canon.get(m.target, m.target))
                new.meta = dict(m.meta)
                inner[m] = new
            else:
                region = _region(m, sub)
                if region is not None:
                    inner[m] = inline(*region)
                    continue
                inner[m] = g.node_copy(m, lambda a: inner[a])
        return []

    for n in src.nodes:
        if n.op == "call_module" or (n.op == "call_function" and n.target in _DROP):
            continue
        region = _region(n, owner) if owner is not None else None
        if region is not None:
            env[n] = inline(*region)
            continue
        if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), list):
            env[n] = env[n.args[0]][n.args[1]]  # a result of an inlined region
            continue
        if n.op == "get_attr" and isinstance(_maybe_submodule(owner, n.target), fx.GraphModule):
            continue  # the body of a region, inlined where it is called
        if n.op == "get_attr":
            new = g.get_attr(canon.get(n.target, n.target))
            new.meta = dict(n.meta)
        else:
            new = g.node_copy(n, lambda a: env[a])
        env[n] = new
        if n.op == "placeholder":
            if ids is not None:
                raise TpirError(Diagnostic("the model's forward takes more than one input",
                                           where=str(n.target),
                                           hint="forward(ids) takes only the (B, T) int64 token ids"))
            ids = new
    if ids is None:
        raise TpirError(Diagnostic("the model's forward takes no input", hint="forward(ids) takes the token ids"))
    _devices_off_meta(g)
    functionalize(g, model_file)
    prune_dead(g)
    for n in g.nodes:
        if n.meta.get("stack_trace"):
            n.meta["stack_trace"] = compact_stack_trace(n.meta["stack_trace"])
    g.lint()
    return g, ids


_CPU = torch.device("cpu")


def _devices_off_meta(g: fx.Graph) -> None:
    """A model built without weights (parameters on the meta device, `weightless.py`) makes the
    tensors it derives from them there too (a mask made `device=embeds.device`); export records
    that device as a constant. The model with weights would have made them on the CPU, where the
    capture's inputs and buffers are, so the compile reads static values (masks, bias tables)
    there. Stage graphs take every device from their input anyway (`stage.py`)."""

    def off_meta(a):
        return _CPU if isinstance(a, torch.device) and a.type == "meta" else a

    for n in g.nodes:
        if n.op == "call_function":
            n.args = fx.node.map_aggregate(n.args, off_meta)
            n.kwargs = fx.node.map_aggregate(n.kwargs, off_meta)


def _maybe_submodule(owner, target: str):
    if owner is None:
        return None
    try:
        return _submodule(owner, target)
    except AttributeError:
        return None
