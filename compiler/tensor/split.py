"""Find the Megatron tensor-parallel split of a stage graph, from the graph alone.

Every value of the graph gets a `Split` or None (replicated: the same on every rank). The graph
is read once, in order:

- A `linear` (or `addmm` / `mm` with the weight as (in, out), GPT-2's Conv1D) whose weight is a
  parameter and whose input is replicated is **column-parallel**: its output is split along the
  last dimension, the weight (and bias) by output rows. When the output is cut along that
  dimension into pieces right after (`split`, `split_with_sizes`, `chunk`, or slices that
  partition it: a fused QKV, Phi-3's fused gate and up), each piece is a segment split on its
  own, so every rank keeps its heads of q, of k and of v.
- The split is followed through every op that keeps the split dimension whole: pointwise ops
  (the `pointwise` tag), casts, transposes and permutes, reshapes and views (the split moves to
  the output dimension that holds it: (B, T, 32) split on 32 becomes (B, T, 4, 8) split on the 4
  heads), slices, concatenations and reductions along other dimensions, rotary embeddings, the
  sliced attention (`causal_attention`: q, k, v split by heads).
- A `linear` / `mm` / `addmm` with a parameter weight whose input is split along the contracted
  dimension is **row-parallel**: the weight is split by input columns, each rank's product is a
  partial sum, and the sum over ranks (g) is replicated again; a bias is added after the sum.
- The **embedding** of the stage's token ids is vocabulary-parallel (rows by vocabulary; ids
  outside the rank's rows look up zeros; the lookups summed). A learned position table whose
  lookup is only added to the token embedding (nanoGPT's and GPT-2's `wte(ids) + wpe(pos)`) is
  split by its columns and folded into that sum (`SplitPlan.folded`): each rank adds its columns
  of the position lookup (zeros elsewhere) to its token lookup before the one all-reduce, so the
  table and its optimizer state cost 1/T and nothing more is communicated. Other embeddings stay
  replicated.
- The **LM head** (the parameter linear whose output is the logits) is column-parallel over the
  vocabulary. When its logits go straight into the loss, the loss is a vocabulary-parallel
  cross-entropy (`SplitPlan.vocab_loss`: no rank gathers the logits); otherwise (a stage that
  returns the logits, or a cast between) the logits are all-gathered.

Grouped-query attention (H query heads, Hkv key/value heads): when T divides Hkv, the key/value
projections are column-parallel like the query's and their heads are split too (the rank's
query heads read exactly the rank's key/value heads). When T does not divide Hkv but Hkv divides
T (and T divides H: fewer key/value heads than ranks, multi-query attention), the key/value
projections stay replicated: every rank computes all Hkv heads and reads, through f, the one
head its H / T query heads share (`SplitPlan.replicated_kv`); its cache holds that one head.
Otherwise the reshape of k or v into heads is refused, naming that dimension.

Anything else a split value reaches is refused: an op that mixes the split dimension (a
reduction, norm or softmax over it, a reshape that merges it with another dimension in a way
the rank cannot compute from its part, a slice along it other than one segment), a pointwise op between a split value
and a replicated one that is not constant along the split dimension, a split value reaching the
stage's residual output, or an op not known to keep the split. The refusal names the parameter
whose split it is, the dimension, T and the model's source line. T must divide the output size
of every column-parallel weight, the heads, and the vocabulary (each refusal names it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from tpc.compiler.frontend import runtime_ops
from tpc.compiler.frontend.axes import size_expr
from tpc.compiler.frontend.calls import call_args, op_name
from tpc.compiler.frontend.source_locations import refuse

aten = torch.ops.aten


@dataclass(frozen=True)
class Split:
    """A value split along `dim`: that dimension is the concatenation of `segments` (their full
    sizes; one segment unless a fused projection is cut in pieces), each cut into T equal
    contiguous parts, rank r holding part r of every segment. `origin` is the parameter whose
    column split made it (for messages)."""

    dim: int
    segments: tuple[int, ...]
    origin: str

    def moved(self, dim: int, segments: tuple[int, ...] | None = None) -> "Split":
        return Split(dim, self.segments if segments is None else segments, self.origin)

    @property
    def size(self) -> int:
        return sum(self.segments)

    @property
    def groups(self) -> int | None:
        """The number of equal segments (None: segments of different sizes)."""
        return len(self.segments) if len(set(self.segments)) == 1 else None


@dataclass(frozen=True)
class ParamSplit:
    """How a full parameter is cut: along `dim`, whose `segments` are each cut into T parts
    (`shard.ParamShard` slices and joins tensors by it); `segments` empty: replicated."""

    name: str
    dim: int = 0
    segments: tuple[int, ...] = ()


@dataclass
class SplitPlan:
    """What `find_split` found, keyed by node name: each value's split (absent: replicated),
    the column- and row-parallel matmuls, the vocabulary-parallel embeddings, the LM head,
    every parameter's split, and the inputs of column-parallel regions (where f goes)."""

    degree: int
    values: dict[str, Split] = field(default_factory=dict)
    column: set[str] = field(default_factory=set)
    row: set[str] = field(default_factory=set)
    embeddings: set[str] = field(default_factory=set)
    head: str | None = None
    params: dict[str, ParamSplit] = field(default_factory=dict)
    region_inputs: set[str] = field(default_factory=set)
    # replicated values read inside a split region, other than by a column-parallel matmul
    # (a per-head norm's weight, a rotary table): each rank's gradient of them is a partial
    # sum, so they are read through f too
    region_reads: set[str] = field(default_factory=set)
    # attentions whose key/value heads are replicated (T does not divide them, they divide T):
    # attention name -> (key/value heads, query heads); rank r reads key/value head r * Hkv // T
    replicated_kv: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the LM head -> the loss that reads its logits directly: the loss is computed on logits
    # split over the vocabulary (absent: the logits are all-gathered)
    vocab_loss: dict[str, str] = field(default_factory=dict)
    # a position table folded into the token embedding's sum: the add -> (the token
    # embedding, the position lookup), the table split by columns (module docstring)
    folded: dict[str, tuple[str, str]] = field(default_factory=dict)

    def kv_head(self, attention: str, rank: int) -> int:
        """The one key/value head the rank's query heads read, at a replicated-KV attention."""
        hkv, _ = self.replicated_kv[attention]
        return rank * hkv // self.degree

    def split_params(self) -> dict[str, ParamSplit]:
        return {n: p for n, p in self.params.items() if p.segments}


# ops that keep every dimension as it is (casts, copies, dropout), beyond the pointwise tag
_SAME_LAYOUT = {"to", "type_as", "_to_copy", "contiguous", "clone", "alias", "detach", "dropout",
                "lift_fresh_copy", "native_dropout"}
_RESHAPES = {"reshape", "view", "_unsafe_view", "flatten", "unflatten", "view_as_complex", "view_as_real",
             "squeeze", "unsqueeze"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "prod", "softmax", "_softmax", "log_softmax",
               "_log_softmax", "norm", "linalg_vector_norm", "logsumexp", "argmax", "argmin"}
_MATMULS = {"linear", "addmm", "mm", "matmul"}


def find_split(graph: fx.Graph, degree: int, params, model_file: str | None = None) -> SplitPlan:
    """The split of `graph` (a stage graph, or the front end's rewritten graph) over `degree`
    tensor ranks; `params` the names of the model's parameters (the other `get_attr`s are
    buffers and constants: replicated). A `TpirError` where the graph cannot be split so."""
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"the tensor degree must be a positive int, not {degree!r}")
    return _Finder(graph, degree, frozenset(params), model_file).run()


class _Finder:
    def __init__(self, graph: fx.Graph, degree: int, params: frozenset[str], model_file: str | None):
        self.g, self.T, self.model_file = graph, degree, model_file
        self.plan = SplitPlan(degree)
        self.params = params
        self.ids = next((n for n in graph.nodes if n.op == "placeholder"), None)
        self.head = _lm_head(graph, self.params)

    # ----------------------------------------------------------------- messages

    def refuse(self, node: fx.Node, message: str, hint: str = ""):
        raise refuse(node, self.model_file, message, hint or (
            "tensor parallelism splits attention by heads and MLPs as column -> row pairs; "
            "choose a tensor degree that divides the dimension, or keep this model at tensor degree 1"))

    def mixes(self, node: fx.Node, s: Split, what: str):
        self.refuse(node, f"cannot split for tensor degree {self.T}: `{op_name(node)}` (node {node.name}) "
                          f"{what} dimension {s.dim} (size {s.size}), which is split from the column-parallel "
                          f"parameter `{s.origin}`",
                    hint="each rank holds 1/T of that dimension between a column-parallel and a row-parallel "
                         "matmul, and this op needs all of it; keep this model at tensor degree 1")

    def divides(self, node: fx.Node, n: int, what: str, origin: str):
        if n % self.T:
            self.refuse(node, f"cannot split for tensor degree {self.T}: {self.T} does not divide {what}, of size "
                              f"{n}, in `{op_name(node)}` (node {node.name}; the split of parameter `{origin}`)")

    # ----------------------------------------------------------------- parameters

    def set_param(self, node: fx.Node, p: fx.Node, ps: ParamSplit):
        old = self.plan.params.get(p.target)
        if old is not None and old != ps:
            self.refuse(node, f"cannot split for tensor degree {self.T}: parameter `{p.target}` is used split two "
                              f"ways (dimension {old.dim} segments {old.segments} and dimension {ps.dim} "
                              f"segments {ps.segments})")
        self.plan.params[p.target] = ps

    def param(self, a) -> fx.Node | None:
        return a if isinstance(a, fx.Node) and a.op == "get_attr" and a.target in self.params else None

    # ----------------------------------------------------------------- the walk

    def run(self) -> SplitPlan:
        for n in self.g.nodes:
            if n.op == "call_function":
                s = self.visit(n)
                if s is not None:
                    self.plan.values[n.name] = s
                    if not isinstance(s, list) and n.target is not runtime_ops.causal_attention:
                        self.plan.region_reads |= {a.name for a in n.all_input_nodes
                                                   if self.spec(a) is None and _is_tensor(a)}
                if n.name not in self.plan.column | self.plan.row | self.plan.embeddings:
                    for a in n.all_input_nodes:  # a parameter read whole
                        if self.param(a) is not None:
                            self.set_param(n, a, ParamSplit(a.target))
            elif n.op == "output":
                outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                if outs and isinstance(outs[0], fx.Node) and outs[0].name in self.plan.values:
                    s = self.plan.values[outs[0].name]
                    self.mixes(outs[0], s, "leaves the stage split along")
        for n in self.g.nodes:  # every other parameter is replicated
            if n.op == "get_attr" and n.target in self.params and n.target not in self.plan.params:
                self.plan.params[n.target] = ParamSplit(n.target)
        if self.T > 1:
            self.fold_positions()
        return self.plan

    def fold_positions(self) -> None:
        """Fold each learned position table whose lookup is only added to a token embedding into
        that embedding's sum (module docstring): the add of the two lookups, each read by the add
        alone, the table a parameter read by that lookup alone, its width divided by T."""
        def same_dtype(a: fx.Node) -> bool:
            dtype, src = a.kwargs.get("dtype"), a.args[0]
            return dtype is None or (isinstance(src, fx.Node) and src.meta.get("val") is not None
                                     and src.meta["val"].dtype == dtype)

        def source(a):  # through copies (and casts to the dtype it has) that only the add reads
            while isinstance(a, fx.Node) and a.op == "call_function" and op_name(a) in _SAME_LAYOUT \
                    and len(a.users) == 1 and same_dtype(a):
                a = a.args[0]
            return a

        for n in self.g.nodes:
            if n.op != "call_function" or op_name(n) != "add" or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
                continue
            a, b = (source(x) for x in n.args)
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            tok, pos = (a, b) if a.name in self.plan.embeddings else (b, a)
            if tok.name not in self.plan.embeddings or len(tok.users) != 1 or op_name(pos) != "embedding" \
                    or len(pos.users) != 1 or pos.name in self.plan.values:
                continue
            table = self.param(pos.args[0])
            if table is None or len(table.users) != 1 or self.plan.params[table.target].segments:
                continue
            width = int(table.meta["val"].shape[1]) if table.meta.get("val") is not None else 0
            if not width or width % self.T:
                continue
            self.plan.params[table.target] = ParamSplit(table.target, 1, (width,))
            self.plan.folded[n.name] = (tok.name, pos.name)

    def spec(self, a) -> Split | None:
        return self.plan.values.get(a.name) if isinstance(a, fx.Node) else None

    def visit(self, n: fx.Node) -> Split | None:
        name = op_name(n)
        if self.T > 1 and name in ("dropout", "native_dropout") and call_args(n).get("train", True) \
                and (call_args(n).get("p") or 0) > 0:
            self.refuse(n, f"cannot split for tensor degree {self.T}: dropout with p = {call_args(n)['p']} "
                           f"(node {n.name}) under tensor parallelism is not built: the ranks would draw different "
                           "masks where the value is replicated",
                        hint="train with dropout 0 under tensor parallelism, or keep this model at tensor degree 1 "
                             "(the evaluation program, which has no dropout, is not affected)")
        ins = [a for a in n.all_input_nodes if self.spec(a) is not None]
        if name in _MATMULS and self.matmul_weight(n) is not None:
            return self.matmul(n, name)
        if name == "embedding":
            return self.embedding(n)
        if name == "getitem":
            parts = self.spec(n.args[0])
            if parts is None:
                return None
            return parts[n.args[1]] if isinstance(parts, list) else self.mixes(n, parts, "indexes along")
        if not ins:
            return None
        if n.meta.get("tpc_kind") == "ssm-scan":
            self.refuse(n, f"cannot split for tensor degree {self.T}: a state-space scan (node {n.name}) reads "
                           f"values split across the tensor group (from `{self.spec(ins[0]).origin}`); splitting "
                           "a scan and its carried state by channels or heads is not built",
                        hint="keep a state-space model at tensor degree 1 (--tensor 1)")
        if n.target is runtime_ops.causal_attention:
            return self.attention(n)
        if name in _SAME_LAYOUT:
            return self.spec(n.args[0])
        if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags:
            return self.pointwise(n)
        if name in ("transpose", "permute", "t"):
            return self.permute(n, name)
        if name in _RESHAPES or name == "expand":
            return self.reshape(n, name)
        if name in ("split", "split_with_sizes", "chunk", "unbind"):
            return self.cut(n, name)
        if name in ("slice", "select", "narrow"):
            s = self.spec(n.args[0])
            d = call_args(n)["dim"] % len(n.args[0].meta["val"].shape)
            if d == s.dim:
                seg = segment_sliced(n, s) if name == "slice" else None
                if seg is None:
                    self.mixes(n, s, "cuts (other than into its segments) along")
                return s.moved(d, (s.segments[seg],))
            return s.moved(s.dim - 1) if name == "select" and d < s.dim else s
        if name == "cat":
            return self.cat(n)
        if name in _REDUCTIONS or name in ("layer_norm", "rms_norm", "native_layer_norm"):
            return self.reduction(n, name)
        s = self.spec(ins[0])
        self.mixes(n, s, "is not known to keep the split of its input along")

    # ----------------------------------------------------------------- rules

    def matmul_weight(self, n: fx.Node):
        """(weight node, input node, bias node, weight is (out, in)) for a matmul by a parameter."""
        name = op_name(n)
        a = call_args(n)
        if name == "linear" and self.param(a["weight"]) is not None:
            return a["weight"], a["input"], a.get("bias"), True
        if name == "addmm" and self.param(a["mat2"]) is not None:
            return a["mat2"], a["mat1"], a["self"], False
        if name in ("mm", "matmul") and self.param(n.args[1]) is not None and n.args[1].meta["val"].dim() == 2:
            return n.args[1], n.args[0], None, False
        return None

    def matmul(self, n: fx.Node, name: str) -> Split | None:
        w, x, b, out_in = self.matmul_weight(n)
        bias = self.param(b)
        if b is not None and bias is None:
            if self.spec(x) is not None:
                self.mixes(n, self.spec(x), "adds a bias that is not a parameter to a product split along")
            return None
        xs = self.spec(x)
        wval = w.meta["val"]
        out_dim, in_dim = (0, 1) if out_in else (1, 0)
        nd = n.meta["val"].dim()
        if xs is None and n.name != self.head and self.replicates_kv(n):
            return None  # the key/value heads are computed whole on every rank
        if xs is None:  # column-parallel (the LM head too)
            n_out = int(wval.shape[out_dim])
            segments = _pieces_after(n, n_out) if n.name != self.head else (n_out,)
            for seg in segments:
                self.divides(n, seg, "the vocabulary" if n.name == self.head else "the output size", w.target)
            self.set_param(n, w, ParamSplit(w.target, out_dim, segments))
            if bias is not None:
                self.set_param(n, bias, ParamSplit(bias.target, 0, segments))
            self.plan.column.add(n.name)
            self.plan.region_inputs.add(x.name)
            if n.name == self.head:
                self.plan.head = n.name
                loss = [u for u in n.users if u.target is runtime_ops.sum_token_loss and u.args[0] is n]
                if len(n.users) == 1 and loss:
                    self.plan.vocab_loss[n.name] = loss[0].name
                return None  # the logits are whole again: gathered, or only their loss is used
            return Split(nd - 1, segments, w.target)
        if xs.dim != x.meta["val"].dim() - 1:
            self.mixes(n, xs, "contracts a dimension other than the split")
        if name == "addmm" and (call_args(n).get("beta", 1) != 1 or call_args(n).get("alpha", 1) != 1):
            self.mixes(n, xs, "scales its bias or product (beta, alpha) while contracting")
        self.set_param(n, w, ParamSplit(w.target, in_dim, xs.segments))
        if bias is not None:
            self.set_param(n, bias, ParamSplit(bias.target))
        self.plan.row.add(n.name)
        return None

    def replicates_kv(self, n: fx.Node) -> bool:
        """Whether `n` projects the keys or values of an attention whose key/value heads Hkv
        T does not divide but which divide T (and T divides the query heads H): then every
        rank computes all key/value heads and reads the one its H / T query heads share."""
        att, pos = _attention_reached(n)
        if att is None or pos not in (1, 2):
            return False
        hq, hkv = int(att.args[0].meta["val"].shape[1]), int(att.args[1].meta["val"].shape[1])
        if hkv % self.T == 0 or self.T % hkv or hq % self.T:
            return False
        if att.kwargs.get("rep", 1) not in (1, hq // hkv) or (att.kwargs.get("rep", 1) == 1
                                                              and not att.kwargs.get("enable_gqa")):
            return False
        self.plan.replicated_kv[att.name] = (hkv, hq)
        return True

    def embedding(self, n: fx.Node) -> Split | None:
        w, ids = n.args[0], n.args[1]
        if self.spec(ids) is not None or self.spec(w) is not None:
            self.mixes(n, self.spec(ids) or self.spec(w), "looks up along")
        p = self.param(w)
        while isinstance(ids, fx.Node) and ids.op == "call_function" and op_name(ids) in _SAME_LAYOUT | {
                "reshape", "view", "_unsafe_view", "flatten", "unsqueeze"}:
            ids = ids.args[0]  # the ids viewed (Hugging Face's input_ids.view(-1, T))
        if p is None or ids is not self.ids:
            return None  # positions, or a table that is not a parameter: replicated
        vocab = int(w.meta["val"].shape[0])
        self.divides(n, vocab, "the vocabulary", p.target)
        self.set_param(n, p, ParamSplit(p.target, 0, (vocab,)))
        self.plan.embeddings.add(n.name)
        return None

    def attention(self, n: fx.Node) -> Split:
        q, k, v, kp, vp = n.args[:5]
        qs, ks, vs = self.spec(q), self.spec(k), self.spec(v)
        if self.T > 1 and (n.kwargs.get("dropout_p") or 0) > 0:
            self.refuse(n, f"cannot split for tensor degree {self.T}: attention dropout with p = "
                           f"{n.kwargs['dropout_p']} (node {n.name}) under tensor parallelism is not built",
                        hint="train with dropout 0 under tensor parallelism, or keep this model at tensor degree 1")
        if self.T > 1 and n.kwargs.get("sink") is not None:
            self.refuse(n, f"cannot split for tensor degree {self.T}: attention sinks (a logit per head, "
                           f"node {n.name}) under tensor parallelism are not built",
                        hint="keep a model with attention sinks at tensor degree 1")
        if n.name in self.plan.replicated_kv and qs is not None and qs.dim == 1 and ks is None and vs is None:
            if n.kwargs.get("bias") is not None:
                self.mixes(n, qs, "adds a position bias table that is not split along")
            return qs
        for s in (qs, ks, vs):
            if s is None or s.dim != 1 or s.groups != 1:
                some = qs or ks or vs
                self.refuse(n, f"cannot split for tensor degree {self.T}: the attention (node {n.name}) reads q, k "
                               f"and v split differently (from `{some.origin}`): each must be split by its heads "
                               "(dimension 1)", hint="replicated key/value heads (grouped-query attention with "
                                                     "fewer key/value heads than ranks) are not built")
        if n.kwargs.get("bias") is not None:
            self.mixes(n, qs, "adds a position bias table that is not split along")
        for p, s in ((kp, ks), (vp, vs)):
            self.plan.values[p.name] = s
        return qs

    def pointwise(self, n: fx.Node) -> Split | None:
        out = n.meta["val"]
        found = None
        for a in n.all_input_nodes:
            val = a.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            shift = out.dim() - val.dim()
            s = self.spec(a)
            if s is not None:
                aligned = s.moved(s.dim + shift)
                if found is not None and (found.dim, found.segments) != (aligned.dim, aligned.segments):
                    self.mixes(n, s, "combines two values split differently along")
                found = aligned if found is None else found
        for a in n.all_input_nodes:
            val = a.meta.get("val")
            if not isinstance(val, torch.Tensor) or self.spec(a) is not None:
                continue
            d = found.dim - (out.dim() - val.dim())
            if d >= 0 and size_expr(val.shape[d]) != 1:
                self.mixes(n, found, f"combines the split value with `{a.name}`, replicated and not constant "
                                     "along")
        return found

    def permute(self, n: fx.Node, name: str) -> Split:
        s = self.spec(n.args[0])
        nd = n.args[0].meta["val"].dim()
        if name == "t":
            order = [1, 0]
        elif name == "transpose":
            d0, d1 = n.args[1] % nd, n.args[2] % nd
            order = list(range(nd))
            order[d0], order[d1] = d1, d0
        else:
            order = [d % nd for d in n.args[1]]
        return s.moved(order.index(s.dim))

    def reshape(self, n: fx.Node, name: str) -> Split:
        s = self.spec(n.args[0])
        ins = [size_expr(d) for d in n.args[0].meta["val"].shape]
        outs = [size_expr(d) for d in n.meta["val"].shape]
        if name == "view_as_complex":  # (..., 2) -> (...): the last dimension is the pair
            outs = outs + [sympy.Integer(2)]
        if name == "view_as_real":
            ins = ins + [sympy.Integer(2)]
        if name == "expand":
            if len(ins) != len(outs) or ins[s.dim] != outs[s.dim]:
                self.mixes(n, s, "expands along")
            return s
        g = s.groups
        if g is None:
            self.mixes(n, s, "reshapes (with segments of different sizes) along")
        # the split dimension is g equal segments, each cut in T parts: in the output it is the
        # dimension k whose leading dimensions hold `ratio` times the input's leading ones, with
        # g / ratio segments left in k, each cut in T parts
        before = sympy.Mul(*ins[: s.dim])
        short = None
        for k, size in enumerate(outs):
            ratio = sympy.simplify(sympy.Mul(*outs[:k]) / before)
            if not (ratio.is_Integer and ratio > 0 and g % int(ratio) == 0) or not size.is_Integer:
                continue
            g2 = g // int(ratio)
            if int(size) % (g2 * self.T) == 0:
                return s.moved(k, (int(size) // g2,) * g2)
            short = short or (k, int(size), g2)
        if short is not None:
            k, size, g2 = short
            what = f"dimension {k} of the result (the heads, where q, k or v is cut into heads)"
            if g2 == 1:
                self.divides(n, size, what, s.origin)
            self.refuse(n, f"cannot split for tensor degree {self.T}: {what} of `{op_name(n)}` (node {n.name}) "
                           f"(size {size}) holds {g2} segments of the split of `{s.origin}`, not divisible into {self.T} "
                           "parts each")
        self.mixes(n, s, "reshapes, mixing with other dimensions,")

    def cut(self, n: fx.Node, name: str):
        s = self.spec(n.args[0])
        a = call_args(n)
        nd = n.args[0].meta["val"].dim()
        d = a.get("dim", 0) % nd
        pieces = n.meta["val"]
        if d != s.dim:
            if name == "unbind":
                return [s.moved(s.dim - (1 if d < s.dim else 0)) for _ in pieces]
            return [s for _ in pieces]
        sizes = tuple(int(p.shape[d]) for p in pieces)
        if name == "unbind" or sizes != s.segments:
            self.mixes(n, s, f"cuts (into pieces {list(sizes)}, not the segments {list(s.segments)}) along")
        return [s.moved(d, (size,)) for size in sizes]

    def cat(self, n: fx.Node) -> Split:
        tensors = n.args[0]
        nd = n.meta["val"].dim()
        d = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % nd
        specs = [self.spec(t) for t in tensors]
        s = next(x for x in specs if x is not None)
        if d == s.dim or any(x is None or (x.dim, x.segments) != (s.dim, s.segments) for x in specs):
            self.mixes(n, s, "concatenates values not all split alike along")
        return s

    def reduction(self, n: fx.Node, name: str) -> Split:
        s = self.spec(n.args[0])
        nd = n.args[0].meta["val"].dim()
        a = call_args(n)
        if name in ("layer_norm", "rms_norm", "native_layer_norm"):
            dims = list(range(nd - len(a["normalized_shape"]), nd))
        else:
            dims = a.get("dim")
            dims = list(range(nd)) if dims is None or dims == [] else ([dims] if isinstance(dims, int) else dims)
            dims = [x % nd for x in dims]
        if s.dim in dims:
            self.mixes(n, s, "reduces (or normalises) over")
        keep = a.get("keepdim", True) if name not in ("softmax", "_softmax", "log_softmax", "_log_softmax") else True
        if keep or name in ("layer_norm", "rms_norm", "native_layer_norm"):
            return s
        return s.moved(s.dim - sum(1 for x in dims if x < s.dim))


def _attention_reached(n: fx.Node) -> tuple[fx.Node | None, int | None]:
    """The sliced attention the value `n` reaches before any matmul, and the position of the
    argument it reaches it by (1: keys, 2: values); (None, None) if none."""
    seen, frontier = {n}, [n]
    while frontier:
        cur = frontier.pop(0)
        for u in cur.users:
            if u in seen or u.op != "call_function":
                continue
            if u.target is runtime_ops.causal_attention:
                return u, next(i for i, a in enumerate(u.args) if a is cur) if cur in u.args else None
            if op_name(u) in _MATMULS:
                continue
            seen.add(u)
            frontier.append(u)
        if len(seen) > 400:
            break
    return None, None


def _is_tensor(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def _slice_range(n: fx.Node, size: int) -> tuple[int, int] | None:
    """[start, stop) of a step-1 `slice` of a dimension of `size` elements."""
    a = call_args(n)
    start, end, step = a.get("start"), a.get("end"), a.get("step", 1)
    if step != 1 or not isinstance(start if start is not None else 0, int) or not isinstance(
            end if end is not None else size, int):
        return None
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else min(end, size))
    return start, end


def segment_sliced(n: fx.Node, s: Split) -> int | None:
    """The index of the segment of `s` that the slice `n` (along the split dimension) cuts out
    exactly, or None."""
    r = _slice_range(n, s.size)
    bounds, start = [], 0
    for seg in s.segments:
        bounds.append((start, start + seg))
        start += seg
    return bounds.index(r) if r in bounds else None


def _pieces_after(n: fx.Node, size: int) -> tuple[int, ...]:
    """The segments of a column-parallel output: the pieces it is cut into along its last
    dimension, after reshapes that keep that dimension, by a `split` / `split_with_sizes` /
    `chunk` (GPT-2's fused QKV, Phi-3's fused gate and up) or by slices that partition it
    (Phi-3's `qkv[..., :q_pos]`, ...); or one segment."""
    cur = n
    while True:
        users = list(cur.users)
        val = cur.meta.get("val")
        last = val.dim() - 1 if isinstance(val, torch.Tensor) else None
        if users and all(op_name(u) == "slice" and call_args(u)["dim"] % val.dim() == last for u in users):
            ranges = sorted({_slice_range(u, size) for u in users} - {None})
            if ranges and ranges[0][0] == 0 and ranges[-1][1] == size and len(ranges) == len(
                    {_slice_range(u, size) for u in users}) and all(
                    a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
                return tuple(b - a for a, b in ranges)
            return (size,)
        if len(users) != 1:
            return (size,)
        u = users[0]
        name = op_name(u)
        val, uval = cur.meta.get("val"), u.meta.get("val")
        if name in ("reshape", "view", "_unsafe_view") and isinstance(uval, torch.Tensor) \
                and int(uval.shape[-1]) == size:
            cur = u
            continue
        if name in ("split", "split_with_sizes", "chunk") and call_args(u).get("dim", 0) % val.dim() == last:
            return tuple(int(p.shape[-1]) for p in uval)
        return (size,)


def _lm_head(graph: fx.Graph, params: set[str]) -> str | None:
    """The parameter linear whose output is the logits: the first argument of the loss, or the
    stage's first output when it has no loss, through casts."""
    out = next(n for n in graph.nodes if n.op == "output")
    cur = next((n.args[0] for n in graph.nodes if n.target is runtime_ops.sum_token_loss), None)
    if cur is None:
        outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        cur = outs[0]
    while isinstance(cur, fx.Node) and op_name(cur) in _SAME_LAYOUT:
        cur = cur.args[0]
    if isinstance(cur, fx.Node) and op_name(cur) in _MATMULS and cur.op == "call_function":
        w = cur.args[1]
        if isinstance(w, fx.Node) and w.op == "get_attr" and w.target in params:
            return cur.name
    return None

