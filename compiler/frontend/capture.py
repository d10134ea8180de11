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
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim, export

from tpc.compiler.frontend.locate import loc_from_traceback
from tpc.compiler.frontend.static import prune_dead
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


def capture(model: nn.Module, seq_len: int, batch: int = 2) -> Captured:
    model_file = model_file_of(model)
    try:
        ep, full_range = _export(model, seq_len, batch, top=max(seq_len, 2)), True
    except _ConstraintViolation:
        # Slicing a buffer of exactly L rows by T makes export guard `T != L`, a guard the graph
        # does not need (buf[:L] is the whole buffer). Capture on [1, L-1]; the graph runs at L
        # unchanged and SlicedModel's self-check then runs the full length to confirm it.
        try:
            ep, full_range = _export(model, seq_len, batch, top=seq_len - 1), False
        except _ConstraintViolation as e:
            raise _capture_error(e.__cause__, model, model_file) from None
        except Exception as e:
            raise _capture_error(e, model, model_file) from None
    except TpirError:
        raise
    except Exception as e:
        raise _capture_error(e, model, model_file) from None
    gm = ep.module()
    canon = _canonical_names(model, gm)
    graph, ids_node = _clean_copy(gm.graph, canon)
    shape = ids_node.meta["val"].shape
    batch_sym, seq_sym = (_sym(shape[0]), _sym(shape[1]))
    if batch_sym is None or seq_sym is None:
        raise TpirError(Diagnostic("the model specialises the batch or sequence length while tracing",
                                   where=model_file or type(model).__name__,
                                   hint="forward must work for every batch size and sequence length"))
    return Captured(gm, graph, ids_node, batch_sym, seq_sym, model_file, canon, full_range)


class _ConstraintViolation(Exception):
    """export specialised the sequence length: the model constrains it."""


def _export(model: nn.Module, seq_len: int, batch: int, top: int):
    # The example length stays below the maximum where it can (at T == L a buffer sliced [:T] is
    # taken whole and export would specialise T), and differs from the example batch, since
    # export gives equal example sizes one symbol.
    t_ex = top - 1 if top >= 4 else top
    b_ex = batch if batch != t_ex else batch + 1
    ids = torch.zeros(b_ex, t_ex, dtype=torch.long)
    dyn = ({0: Dim("batch", min=1), 1: Dim("seq", min=1, max=top)},)
    try:
        return export(model, (ids,), dynamic_shapes=dyn, strict=False)
    except Exception as e:
        if "Constraints violated" in str(e) and top > 2:
            raise _ConstraintViolation() from e
        raise


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


def _clean_copy(src: fx.Graph, canon: dict[str, str]) -> tuple[fx.Graph, fx.Node]:
    """Copy without export's guard module call and metadata asserts; canonical attribute names."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ids = None
    for n in src.nodes:
        if n.op == "call_module" or (n.op == "call_function" and n.target in _DROP):
            continue
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
    prune_dead(g)
    g.lint()
    return g, ids


