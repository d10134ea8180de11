"""`SlicedModel`: capture, analyse and rewrite a model once; cut it into stages on demand.

The capture (`capture.py`: torch.export, then a clean copy in which in-place writes are values,
`functional.py`, and library no-ops are gone, `simplify.py`) makes the context (`context.py`).
Then the passes of `PASSES` run in one loop, `run_passes`: each reads the context and returns it
with what it made; after each, the graph is linted and its static values are recomputed.

  pass                what it does                                               module
  logits              the model returns (batch, seq, vocab) logits                capture.py
  attention           causal attention sliced over a KV cache, masks read         attention.py
  causal-state        the last tokens of short causal mixers carried              carried_state.py
  scan-state          a state-space scan's final state carried                    ssm_state.py
  expert-dispatch     mixture-of-experts grouping undone: token-local             experts.py
  token-independence  any other mixing of tokens refused                          analyse.py
  positions           positions put on the slice's window [offset, offset + l)   positions.py
  units               cut where only the residual stream is live                  partition.py (`CutUnits` here)
  costs               a cost record on every node                                 flops.py

Then the numeric self-check (`check_slicing`). Stage graphs are cut from the final context on
demand (`stage_module`, `stage.py`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Sequence

import sympy
import torch
import torch.fx as fx
import torch.nn as nn

from tpc.compiler.frontend.analyse import CheckTokenIndependence
from tpc.compiler.frontend.attention import SliceAttention
from tpc.compiler.frontend.axes import is_residual_stream, size_expr
from tpc.compiler.frontend.capture import Captured, CheckLogits, capture
from tpc.compiler.frontend.carried_state import CarryCausalState
from tpc.compiler.frontend.context import Pass, PassContext
from tpc.compiler.frontend.experts import RecogniseExpertDispatch
from tpc.compiler.frontend.flops import AnnotateCosts, UnitCost, UnitCostFn, loss_cost, numel as numel_of, sum_costs
from tpc.compiler.frontend.partition import make_units, partition_balanced
from tpc.compiler.frontend.positions import WindowPositions
from tpc.compiler.frontend.source_locations import refuse
from tpc.compiler.frontend.ssm_state import STATE, CarryScanState
from tpc.compiler.frontend.stage import StageModule, build_stage_graph
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Loc


DEFAULT = object()  # from_model's default self-check slices


class CutUnits:
    """The data values cut into partition units where only the residual stream is live, merged
    by the numbered block they belong to (`partition.py`)."""

    name = "units"

    def run(self, ctx: PassContext) -> PassContext:
        output = next(n for n in ctx.graph.nodes if n.op == "output")
        units = make_units(ctx.data_nodes, ctx.logits, output, ctx.batch_sym, ctx.seq_sym)
        return replace(ctx, units=tuple(units))


# the front end's passes, in the order they run (the module docstring)
PASSES: tuple[Pass, ...] = (CheckLogits(), SliceAttention(), CarryCausalState(), CarryScanState(),
                            RecogniseExpertDispatch(),
                            CheckTokenIndependence(),
                            WindowPositions(), CutUnits(), AnnotateCosts())


def run_passes(ctx: PassContext, passes: Sequence[Pass] = PASSES) -> PassContext:
    """Run `passes` in order over `ctx`; after each, lint the graph and recompute its static
    values. Returns the last context."""
    ctx = ctx.with_static()
    for p in passes:
        ctx = p.run(ctx)
        try:
            ctx.graph.lint()
        except RuntimeError as e:
            raise RuntimeError(f"internal: the graph is malformed after the front end's pass `{p.name}`: {e}") from e
        ctx = ctx.with_static()
    return ctx


def initial_context(model: nn.Module, cap: Captured, seq_len: int, vocab: int) -> PassContext:
    """The context the passes start from: the captured graph with an `offset` placeholder (the
    slice's first token) after the ids, and `model`'s parameters and buffers to read."""
    named = dict(model.named_parameters())
    named_buf = dict(model.named_buffers())

    def read_attr(name: str):
        if name in named:
            return named[name]
        if name in named_buf:
            return named_buf[name]
        obj = cap.gm
        for p in name.split("."):
            obj = getattr(obj, p)
        return obj

    graph = cap.graph
    with graph.inserting_after(cap.ids):
        offset = graph.placeholder("offset")
    offset.meta["val"] = 0
    return PassContext(graph=graph, ids=cap.ids, offset=offset, batch_sym=cap.batch_sym, seq_sym=cap.seq_sym,
                       seq_len=seq_len, vocab=vocab, model_name=type(model).__name__,
                       model_file=cap.model_file, read_attr=read_attr, param_names=frozenset(named))


class SlicedModel:
    """A model made token-sliceable, numbered into partition units."""

    @classmethod
    def from_model(cls, model: nn.Module, seq_len: int, vocab: int, check_slices=DEFAULT) -> "SlicedModel":
        """`check_slices`: the slice lengths of the numeric self-check (summing to `seq_len`);
        by default one token, then two unequal slices; None skips it (call `check_slicing` with
        the plan's own slices instead)."""
        return cls(model, seq_len, vocab, check_slices)

    def __init__(self, model: nn.Module, seq_len: int, vocab: int | None, check_slices=DEFAULT):
        self.model, self.seq_len = model, seq_len
        cap = capture(model, seq_len)
        # a model without weights is never run before the capture: its vocabulary is the logits'
        self.vocab = vocab = vocab if vocab is not None else _traced_vocab(cap)
        self._model_file = cap.model_file
        self._full_range = cap.full_range
        self._original = fx.Graph()  # the captured graph before any pass: the self-check's reference
        self._original.output(self._original.graph_copy(cap.graph, {}))
        ctx = run_passes(initial_context(model, cap, seq_len, vocab))
        self._ctx = ctx
        # shorthands for the methods below (and the tests that inspect the rewrite)
        self._graph, self._static, self._fetch = ctx.graph, ctx.static, ctx.fetch
        self._batch_sym, self._seq_sym = ctx.batch_sym, ctx.seq_sym
        self._sites, self._states = list(ctx.attention), list(ctx.states)
        self._units = ctx.units
        self._unit_attrs = [self._attrs_used(u.nodes) for u in self._units]
        self.hidden_size = self._hidden(ctx.data_nodes)
        self._cost_fns: dict[int, list[UnitCostFn]] = {}
        if check_slices is DEFAULT:
            check_slices = default_check_slices(seq_len)
        if check_slices is not None:
            self.check_slicing(check_slices)

    # ---------------------------------------------------------------- public API

    @property
    def context(self) -> PassContext:
        """The front end's final context: the rewritten graph (`graph`), its units (`units`),
        the sites that cache tensors across slices (`attention`, `states`, `cache_sites`), its
        static values (`static`) and how to read its attributes (`fetch`)."""
        return self._ctx

    @property
    def num_units(self) -> int:
        return len(self._units)

    @property
    def unit_labels(self) -> list[str]:
        return [u.label for u in self._units]

    @property
    def unit_param_counts(self) -> list[int]:
        """Parameters each unit uses (a tied parameter counts in every unit that uses it)."""
        named = dict(self.model.named_parameters())
        return [sum(named[a].numel() for a in attrs if a in named) for attrs in self._unit_attrs]

    def stage_param_count(self, lo: int, hi: int) -> int:
        """Distinct parameters units [lo, hi) use (a tied weight counts once)."""
        named = dict(self.model.named_parameters())
        names = {a for attrs in self._unit_attrs[lo:hi] for a in attrs if a in named}
        return sum(named[a].numel() for a in names)

    def stage_param_names(self, lo: int, hi: int) -> set[str]:
        """The parameters units [lo, hi) use, by canonical name (what a rank holding them builds)."""
        return {a for attrs in self._unit_attrs[lo:hi] for a in attrs if a in self._ctx.param_names}

    @property
    def unit_kv_elements(self) -> list[int]:
        """Cached elements one token of one sequence leaves in each unit (keys + values, and
        the inputs of short causal mixers; a scan's state is per sequence, not per token)."""
        return [sum(n for n, w in caches if w != STATE) for caches in self.unit_kv]

    @property
    def unit_kv(self) -> list[list[tuple[int, int | None]]]:
        """Per unit, its caches: (elements one token of one sequence leaves, window). A window
        w (a sliding-window layer; a causal convolution or shift reading w - 1 earlier tokens)
        means later slices read only the last w - 1 tokens, so the cache a runtime must keep is
        bounded by w - 1 tokens plus the slice being appended. A state-space scan's carried state
        is (elements of one sequence's state, `STATE`): the same size whatever the tokens."""
        out: list[list] = [[] for _ in range(self.num_units)]
        for s, u in zip(self._ctx.cache_sites, self._ctx.site_units):
            n = sum(self._per_token(value) for value, *_ in s.cached)
            out[u].append((n, STATE if s.per_slice else s.window))
        return out

    def _per_token(self, node: fx.Node) -> int:
        """Elements of one token of one sequence of a cached value."""
        return int(numel_of(node.meta["val"]).subs({self._batch_sym: 1, self._seq_sym: 1}))

    @property
    def float_bytes(self) -> int:
        """Bytes of a floating-point element as traced (the parameters' dtype)."""
        p = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        return p.element_size() if p is not None else 4

    def unit_cost_fns(self, float_bytes: int | None = None) -> list[UnitCostFn]:
        """Per unit, `fn(l, c, b) -> UnitCost` from the graph's cost records (flops.py): the
        unit's nodes, the static values it recomputes (position tables, weight views) and, on
        the last unit, the loss. Floating values count `float_bytes` each (default: as traced).
        Lambdified once per width; identical units share one function."""
        width = self.float_bytes if float_bytes is None else int(float_bytes)
        if width not in self._cost_fns:
            by_sig: dict[tuple, UnitCostFn] = {}
            fns = []
            for i, u in enumerate(self._units):
                nodes = list(u.nodes) + self._static_used(u.nodes)
                records = [n.meta["tpc_cost"] for n in nodes]
                if i == self.num_units - 1:
                    records.append(loss_cost(u.output.meta["val"]))
                sums = sum_costs(records)
                key = tuple(sympy.srepr(sums[k]) for k in sorted(sums))
                if key not in by_sig:
                    by_sig[key] = UnitCostFn(u.label, sums, self._seq_sym, self._batch_sym, width)
                fn = by_sig[key]
                fns.append(fn if fn.label == u.label else fn.relabel(u.label))
            self._cost_fns[width] = fns
        return self._cost_fns[width]

    def unit_costs(self, l, c, b, float_bytes: int | None = None) -> list[UnitCost]:
        """Each unit's forward and backward FLOPs, bytes and kernels for slices of `l` tokens
        after `c` cached ones, `b` sequences (numpy arrays broadcast together)."""
        return [fn(l, c, b) for fn in self.unit_cost_fns(float_bytes)]

    def partition_by_params(self, n_stages: int) -> list[tuple[int, int]]:
        """Contiguous unit ranges, one per stage, balancing parameter counts."""
        self._check_stages(n_stages)
        return partition_balanced(self.unit_param_counts, n_stages)

    def ties(self, ranges) -> list[tuple[str, tuple[int, ...]]]:
        """Parameters used by several stages (weight tying), with the stages that use them."""
        users: dict[str, list[int]] = {}
        for s, (lo, hi) in enumerate(ranges):
            for u in range(lo, hi):
                for a in self._unit_attrs[u]:
                    if a in self._ctx.param_names and s not in users.setdefault(a, []):
                        users[a].append(s)
        return [(name, tuple(st)) for name, st in sorted(users.items()) if len(st) >= 2]

    @property
    def original_graph(self) -> fx.Graph:
        """The captured graph before any pass: the self-check's reference."""
        return self._original

    def stage_module(self, lo: int, hi: int, params_from: nn.Module | None = None,
                     with_loss: bool = True, evaluation: bool = False, dropped=(), documents: bool = False) -> StageModule:
        """Units [lo, hi) as a `StageModule`; `evaluation`: as `model.eval()` runs them
        (dropout off, `inference.py`); `dropped`: units (of all the model's) that run on a
        subset of each slice's tokens (random layerwise token dropping, `random_ltd.py`);
        `documents`: over rows of packed documents (`documents.py`: positions restart at each
        document, attention stays inside it)."""
        if not (0 <= lo < hi <= self.num_units):
            raise ValueError(f"unit range {lo}:{hi} is not inside 0:{self.num_units}")
        drop = tuple(sorted(u for u in set(dropped) if lo <= u < hi))
        if documents and drop:
            raise TpirError(Diagnostic("random layerwise token dropping over packed documents is not built",
                                       where="--random-ltd", hint="drop --random-ltd or --documents"))
        graph, sites = build_stage_graph(self._ctx, lo, hi, with_loss, frozenset(drop))
        if documents:
            from tpc.compiler.frontend.documents import document_graph, refuse_unresettable

            refuse_unresettable(sites, self._model_file)
            graph = document_graph(graph)
        if evaluation:
            from tpc.compiler.frontend.inference import without_dropout

            graph = without_dropout(graph)
        src = params_from if params_from is not None else self.model
        params = dict(src.named_parameters())
        buffers = dict(src.named_buffers())
        attrs = {}
        for n in graph.nodes:
            if n.op != "get_attr":
                continue
            t = n.target
            if t in params:
                attrs[t] = ("param", params[t])
            elif t in buffers:
                attrs[t] = ("buffer", buffers[t])
            else:
                attrs[t] = ("const", self._fetch(t))
        kv_dims, shapes, dtypes, windows = [], [], [], []
        for s in sites:
            for node, _, d, window in s.cached:
                kv_dims.append(d)
                shapes.append(self._shape_fn(node.meta["val"], d if s.per_slice else None))
                dtypes.append(node.meta["val"].dtype)
                windows.append(window)
        label = self.unit_labels[lo] if hi - lo == 1 else f"{self.unit_labels[lo]} .. {self.unit_labels[hi - 1]}"
        if documents:
            self._check_batch_first(shapes)
        return StageModule(graph, attrs, lo, hi, self.num_units, kv_dims, shapes, dtypes, label, with_loss,
                           kv_windows=windows, dropped=drop, documents=documents)

    def check_documents(self) -> None:
        """Refuse packed documents for a model whose positions or state cannot be reset at a
        document boundary (`documents.py`), at the model's line."""
        from tpc.compiler.frontend.documents import refuse_unresettable

        refuse_unresettable(self._ctx.cache_sites, self._model_file)
        shapes = [self._shape_fn(node.meta["val"]) for s in self._ctx.cache_sites for node, *_ in s.cached]
        self._check_batch_first(shapes)

    def _check_batch_first(self, shapes) -> None:
        """Over packed documents a stage runs its rows one at a time: every cached tensor must hold
        the batch on its first axis (BLOOM's (batch * heads, tokens, head_dim) too: a row is
        `heads` consecutive entries)."""
        for shape in shapes:
            one, two = shape(1), shape(2)
            if two[0] != 2 * one[0] or one[1:] != two[1:]:
                raise TpirError(Diagnostic(
                    "packed documents: a cached key/value tensor does not hold the batch on its first "
                    f"axis (shape {one} at batch 1), so a row's cache cannot be taken apart",
                    where=type(self.model).__name__,
                    hint="lay keys and values out as (batch, heads, tokens, head_dim), or compile without "
                         "--documents"))

    # ---------------------------------------------------------------- helpers

    def _shape_fn(self, val, entries_axis: int | None = None):
        """batch -> the shape of a cached tensor holding no tokens: its token axis 0 (a state
        carried per slice, `ssm_state.ScanSite`: its axis of entries, `entries_axis`, 0)."""
        exprs = [size_expr(d) for d in val.shape]
        if entries_axis is not None:
            exprs[entries_axis] = sympy.Integer(0)
        b, t = self._batch_sym, self._seq_sym
        return lambda batch: tuple(int(e.subs({b: batch, t: 0})) for e in exprs)

    def _check_stages(self, n_stages: int) -> None:
        if not isinstance(n_stages, int) or n_stages < 1 or n_stages > self.num_units:
            raise TpirError(Diagnostic(
                f"cannot cut the model into {n_stages} pipeline stages: it has {self.num_units} units "
                f"({', '.join(self.unit_labels)})",
                where=type(self.model).__name__,
                hint=f"choose between 1 and {self.num_units} stages"))

    def _attrs_used(self, nodes) -> list[str]:
        seen, out, stack = set(), [], [a for n in nodes for a in n.all_input_nodes]
        while stack:
            a = stack.pop()
            if a in seen or a not in self._static:
                continue
            seen.add(a)
            if a.op == "get_attr":
                out.append(a.target)
            stack.extend(a.all_input_nodes)
        return sorted(set(out))

    def _static_used(self, nodes) -> list[fx.Node]:
        """Static call nodes `nodes` depend on (a stage recomputes them), in graph order."""
        seen, stack = set(), [a for n in nodes for a in n.all_input_nodes]
        while stack:
            a = stack.pop()
            if a in seen or a not in self._static:
                continue
            seen.add(a)
            stack.extend(a.all_input_nodes)
        return [n for n in self._graph.nodes if n in seen and n.op == "call_function"]

    def _hidden(self, data) -> int:
        for u in self._units[:-1]:
            return int(u.output.meta["val"].shape[2])
        for n in data:
            if is_residual_stream(n, self._batch_sym, self._seq_sym):
                return int(n.meta["val"].shape[2])
        return 0

    def check_slicings(self, slicings):
        """`check_slicing` with each slicing of `slicings`. A model built without weights
        (`weightless.py`) is checked unit by unit (`unit_check.py`: each distinct unit's weights
        made real in turn, its stage graph against the captured graph, at a length the check
        can afford); returns what that check ran (a `UnitCheck`: units and length) then, else
        None."""
        from tpc.compiler.frontend.weightless import holds_weights

        slicings = [[int(x) for x in lens] for lens in slicings]
        for lens in slicings:
            if sum(lens) != self.seq_len or min(lens) < 1:
                raise ValueError(f"slices {lens} do not cover the {self.seq_len} tokens of the plan")
        if holds_weights(self.model):
            for lens in slicings:
                self.check_slicing(lens)
            return None
        if self._has_active_dropout():
            return None  # random masks differ between the two runs; nothing to compare
        from tpc.compiler.frontend.unit_check import check_units

        def refuse_difference(token, lens, node):
            self._refuse_node(node, token, lens)

        from tpc.compiler.frontend.unit_check import NodeFailed

        try:
            return check_units(self, slicings, _iter_sliced, refuse_difference)
        except NodeFailed as e:
            first = str(e.error).splitlines()[0] if str(e.error) else ""
            raise refuse(e.node, self._model_file,
                         f"the model does not run at the plan's length of {self.seq_len} tokens: "
                         f"{type(e.error).__name__}: {first}", _TOO_LONG) from None

    def _has_active_dropout(self) -> bool:
        return any(n.target is torch.ops.aten.dropout.default and n.args[1] and n.args[2]
                   for n in self._graph.nodes if n.op == "call_function")

    def check_slicing(self, lens) -> None:
        """The numeric self-check: the whole model run slice by slice (lengths `lens`, summing
        to the plan's length) must give the unsliced model's logits on random tokens. A safety
        net for token mixing the rules of the passes do not know; a difference is refused,
        naming the first value of the graph whose sliced value differs and its source line.
        Skipped when the model has active dropout (the two runs draw different masks)."""
        from tpc.compiler.frontend.weightless import holds_weights

        lens = [int(x) for x in lens]
        if sum(lens) != self.seq_len or min(lens) < 1:
            raise ValueError(f"slices {lens} do not cover the {self.seq_len} tokens of the plan")
        if not holds_weights(self.model):
            self.check_slicings([lens])
            return
        if self._has_active_dropout():
            return  # random masks differ between the two runs; nothing to compare
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab, (2 if self._full_range else 1, self.seq_len), generator=gen)
        full = self.stage_module(0, self.num_units, with_loss=False)
        with torch.no_grad():
            ref = _run_model_at_length(self.model, ids)
            got = torch.cat(_run_sliced(full, ids, lens), dim=1)
        err = (got - ref).abs()
        tol = 1e-4 * (1.0 + ref.abs().max().item())
        if err.max().item() > tol:
            bad = int(err.amax(dim=(0, 2)).gt(tol).nonzero()[0])
            self._refuse_difference(ids, lens, full, bad)
        del ref, got
        self._check_backward(ids, lens, full)

    def _check_backward(self, ids, lens, full) -> None:
        """The whole model's backward, sliced (`backward_check.py`), against the model's own
        autograd: every parameter's gradient. Gradients the parameters held are kept."""
        from tpc.compiler.frontend.backward_check import compare_gradients, sliced_backward

        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        held = {n: p.grad for n, p in params.items()}
        try:
            for p in params.values():
                p.grad = None
            with torch.enable_grad(), _state_kept(self.model):
                out = self.model(ids)
                weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
                (out * weight).sum().backward()
                del out
                ref = {n: p.grad for n, p in params.items()}
                for p in params.values():
                    p.grad = None
                sliced_backward(full, ids, lens, weight, self._model_file)
            compare_gradients({n: p.grad for n, p in params.items()}, ref, f"slices {_short(lens)}")
        finally:
            for n, p in params.items():
                p.grad = held[n]

    def _refuse_difference(self, ids, lens, full, token: int) -> None:
        from tpc.compiler.frontend.first_difference import first_difference

        self._refuse_node(first_difference(self._original, self._fetch, self._seq_sym, ids, lens, full), token, lens)

    def _refuse_node(self, node, token: int, lens) -> None:
        what = f"slicing changes the model's output (first at token {token}, slices {_short(lens)})"
        hint = ("use only per-token operations, causal attention (scaled_dot_product_attention("
                "is_causal=True)) and positions from arange(T) or buf[:T]")
        if node is None:
            raise TpirError(Diagnostic(what + ": the model mixes tokens in a way the front end does not "
                                       "recognise", where=type(self.model).__name__, hint=hint))
        raise refuse(node, self._model_file,
                     f"{what}: the first value that differs is `{node.name}` (op {node.target}); the "
                     "model mixes tokens there in a way the front end does not recognise", hint)



def _traced_vocab(cap: Captured) -> int | None:
    """The last dimension of the captured model's output, when it is a fixed size."""
    out = next(n for n in cap.graph.nodes if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    v = vals[0].meta.get("val") if vals and isinstance(vals[0], fx.Node) else None
    if isinstance(v, torch.Tensor) and v.dim() == 3 and isinstance(v.shape[2], int):
        return int(v.shape[2])
    return None


def default_check_slices(seq_len: int) -> list[int]:
    """One token, then two unequal slices: [1, ~L/2 - 1, ~L/2]."""
    if seq_len < 4:
        return [1] * seq_len
    half = seq_len // 2
    return [1, half - 1, seq_len - half]


def _short(lens) -> str:
    text = ", ".join(map(str, lens[:6]))
    return f"[{text}{', ...' if len(lens) > 6 else ''}]"


def _run_sliced(stage: StageModule, ids, lens) -> list:
    """The outputs of `stage` (every unit, no loss) on `ids`, slice by slice."""
    return list(_iter_sliced(stage, ids, lens))


def _iter_sliced(stage: StageModule, ids, lens):
    """`_run_sliced`'s outputs one at a time, as each slice is run."""
    prefix = stage.empty_kv(ids.size(0))  # the cache: every earlier slice's K/V, one tensor each
    off = 0
    for ln in lens:
        y, kv = stage(ids[:, off:off + ln], off, prefix)
        prefix = [torch.cat([p, k], dim=d) for p, k, d in zip(prefix, kv, stage.kv_dims)]
        del kv
        yield y
        off += ln



@contextmanager
def _state_kept(model: nn.Module):
    """Run the user's model for a check and leave it as it was: the tensors (or None) its
    modules hold outside their parameters and buffers are put back afterwards (RecurrentGemma
    keeps its last recurrent state on the module, a tensor of the check's autograd graph that a
    later `copy.deepcopy(model)` would refuse)."""
    held = [(m, k, v) for m in model.modules() for k, v in vars(m).items()
            if not k.startswith("_") and (v is None or isinstance(v, torch.Tensor))]
    try:
        yield
    finally:
        for m, k, v in held:
            setattr(m, k, v)


def _run_model_at_length(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The unsliced model on `ids` at the plan's length. A model that cannot run at that length
    (a position table shorter than --seq-len, say) is refused at the model's own line that
    failed, instead of a traceback from inside torch."""
    import traceback

    try:
        with _state_kept(model):
            return model(ids)
    except (IndexError, RuntimeError, ValueError) as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if "site-packages" not in f.filename and "/torch/" not in f.filename]
        last = frames[-1] if frames else None
        loc = None
        if last is not None:
            import linecache

            text = linecache.getline(last.filename, last.lineno or 1)
            loc = Loc(last.filename, last.lineno or 1, len(text) - len(text.lstrip()) + 1)
        raise TpirError(Diagnostic(
            f"the model does not run at the plan's length of {ids.shape[1]} tokens: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            loc, hint=_TOO_LONG, where="--seq-len")) from None


_TOO_LONG = ("a table sized for a shorter context (positions, a causal mask buffer) ends before --seq-len: "
             "give a --seq-len the model supports, or build the model for a longer context")
