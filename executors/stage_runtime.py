"""Runs one pipeline stage one token slice at a time, owning its KV caches and their gradients.

Semantics (DESIGN.md section 4): a slice's forward reads the keys/values of the earlier slices
of its micro-batch as a detached leaf that requires grad, so its backward leaves there the
gradients it sends into them. When an earlier slice runs backward, the gradients later slices
sent into its keys/values are the upstream gradients of its K/V outputs: one autograd call over
[output, k..., v...] per slice. Parameter gradients accumulate in .grad across slices and
micro-batches.

Memory layout: one buffer per micro-batch and cached tensor holds every token's keys/values so
far; a slice writes its own tokens into it once, and reads its prefix as a view (no copy), so
the only copy of the prefix is the one attention makes when it appends the slice's own keys.
When the caller says how many tokens the micro-batch has (`capacity`, the end of its last slice:
the engine knows it from the plan), the first slice allocates the whole buffer and it never
moves. Without it the buffer grows by doubling; then an earlier slice's prefix leaf keeps the
smaller buffer it viewed alive until its backward, up to twice the cache's bytes. The
gradients sent into the cache collect in one buffer of the same layout, from which each slice
takes its own tokens' region when it runs backward. (Joining per-slice leaves instead copied the
whole prefix twice per slice: O(n²) copies for n slices.)

The cached tensors are attention keys and values and the inputs of short causal mixers (a causal
convolution of kernel k or a token shift reads the last k - 1 tokens of its input: a window of
k, `compiler/frontend/carried_state.py`); the runtime treats them alike.

Sliding-window layers (`module.kv_windows`, window w): a later slice reads only the last w - 1
tokens, so the cache keeps only those plus the slice being appended. When the buffer is full, its
last w - 1 tokens move to its front, in place; a prefix leaf that viewed the overwritten tokens
is only a receiver of gradients by then (attention concatenates the prefix into a new tensor,
which is what its backward keeps), except for a checkpointed slice, which keeps a copy of its
windowed prefix to recompute from. Gradients sent into a windowed cache collect in a buffer of
at most w - 1 tokens: by the time slice i runs backward every later slice has, and only the
w - 1 tokens before slice i can still receive gradients. So a windowed layer's cache and its
gradients take O(w) memory however long the sequence.

Packed documents (`forward(..., documents=starts)`): a slice reads only the tokens of the
documents its rows' first tokens are in (`StageModule.forward` narrows each row's prefix), and
none when every row starts a document at it. After each slice the runtime drops the tokens of
documents no later slice reads (`_drop_finished`: those before the document each row's next token
is in, the earliest over the rows): the live tokens move to a buffer of their own, which grows by
doubling from there, and a slice's prefix leaves are copies of the live tokens rather than views,
so that a finished document's buffer goes once nothing reads it. The gradients sent into the cache
collect as a window's do, per region read. A checkpointed forward keeps everything after it (its
recompute reads its prefix again). So the cache holds about one document per row, not the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpc.compiler.frontend import StageModule
from tpc.compiler.programs.joint import Programs, Shape
from tpc.compiler.programs.stage_programs import StagePrograms


@dataclass
class _Slice:
    mb: int
    x: torch.Tensor  # input (leaf requiring grad, or ids on the first stage)
    offset: int
    targets: torch.Tensor | None
    start: int  # tokens of this micro-batch before this slice (its prefix length)
    length: int  # tokens of this slice
    prefix: list = field(default_factory=list)  # the leaves this slice read its prefix through
    # random layerwise token dropping: per dropped unit of the stage, the slice's kept positions
    # (None: every token); a dropped unit's cache holds its kept tokens only, so each cached
    # tensor has its own count of earlier tokens (`starts`) and of this slice's (`lengths`)
    keep: list | None = None
    starts: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    window_copies: list | None = None  # checkpointed: copies of its windowed prefixes, to recompute from
    # the graph-connected output (None while checkpointed): on the last stage the loss; on
    # any other its gradient edge only (`_output`), so that the activation itself is freed
    # once its send completes, not held until the backward
    y: object = None
    kv_out: list = field(default_factory=list)  # graph-connected K/V outputs
    # with programs (`StageRuntime.programs`), what stands for the autograd graph: the slice's
    # programs, the values its forward saved for the backward (None while checkpointed), what
    # its backward_input held for backward_weight, and its keys/values' (shape, dtype)
    programs: Programs | None = None
    values: list | None = None
    held: list | None = None
    kv_meta: list = field(default_factory=list)
    y_meta: tuple | None = None
    held_bytes: int = 0  # of `held`, what backward_input computed (not the forward's saved values)
    sent_kv_grads: bool = False  # backward (or backward_input) ran: earlier slices' K/V grads are final
    # over packed documents: each row's document starts (`StageModule.forward`); None otherwise
    documents: tuple | None = None


@dataclass
class _Acc:
    """Gradients sent into the tokens [base, base + g.size(d)) of one cached tensor."""

    g: torch.Tensor
    base: int = 0


@dataclass
class _Cache:
    """One micro-batch's keys/values on this stage, and the gradients sent into them."""

    kv: list  # per cached tensor: a buffer holding the tokens [base[t], filled[t])
    length: int = 0  # the micro-batch's tokens so far (the slices' lengths)
    grad: list | None = None  # per cached tensor an _Acc (None: nothing received yet)
    base: list = field(default_factory=list)  # per cached tensor: the token at buffer index 0
    # per cached tensor: its tokens so far (`length`, but a dropped unit's holds its kept ones)
    filled: list = field(default_factory=list)
    # over packed documents: a checkpointed slice will read its prefix again when recomputed, so
    # no finished document is dropped from this micro-batch's cache after it
    keep_all: bool = False


def storage_key(t: torch.Tensor) -> tuple:
    """What tells one tensor's storage from another's (views of one storage share it)."""
    st = t.untyped_storage()
    return st.device.type, st.data_ptr()


def _dense(t):
    """`t` contiguous: a program is specialised to its inputs' layouts (`Shape.layout`), and a
    slice of the ids or targets is a strided view whose strides depend on the batch's length."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _leaf(cached: torch.Tensor) -> torch.Tensor:
    """A slice's view of cached tokens as a leaf: one that requires grad, so the slice's backward
    leaves in it the gradients it sends into the earlier slices; a cache of token ids (a shift
    of the ids themselves) carries none."""
    leaf = cached.detach()
    return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf


class _PairCache:
    """What the program of two slices a, a + 1 (`StageRuntime.forward_pair`) hands slice a's
    cached tensors to (`write`: appended to the micro-batch's cache at once) and takes slice
    a + 1's prefixes from (`prefix`: leaves viewing the cache, a's tokens included)."""

    def __init__(self, runtime: "StageRuntime", mb: int, capacity: int | None, leaves: bool = True):
        self.runtime, self.cache, self.capacity = runtime, runtime._caches[mb], capacity
        self.as_leaves = leaves  # prefixes as leaves that require grad (training), else plain views
        n = runtime.module.num_kv
        self.starts: list = [None] * n
        self.leaves: list = [None] * n

    def write(self, t: int, value: torch.Tensor) -> None:
        self.runtime._append_one(self.cache, t, value, self.capacity)

    def prefix(self, t: int) -> torch.Tensor:
        self.starts[t] = self.cache.filled[t]
        view = self.runtime._prefix_view(self.cache, t, self.cache.filled[t])
        self.leaves[t] = leaf = _leaf(view) if self.as_leaves else view
        return leaf


class _GradPair:
    """What the program of two backwards (`StageRuntime.backward_pair`) hands slice b's prefix
    gradients to (`write`: added into the micro-batch's gradients at once) and takes slice a's
    upstream gradients of its cached tensors from (`prefix`)."""

    def __init__(self, runtime: "StageRuntime", b: _Slice, a: _Slice):
        self.runtime, self.b, self.a = runtime, b, a

    def write(self, t: int, grad) -> None:
        self.runtime._send_prefix_grad(self.b, t, grad)

    def prefix(self, t: int) -> torch.Tensor:
        rt = self.runtime
        return rt._kv_tangent(self.a, t, rt._kv_grad(rt._caches[self.a.mb], t, self.a))


class StageRuntime:
    """`programs`: run the slices through the stage's programs derived from its joint graph
    (`tpc.compiler.programs`), compiled or not, instead of eager autograd: what a split backward
    (`backward_input`, `backward_weight`) needs, and what `--compile` runs."""

    def __init__(self, module: StageModule, loss_scale: float, programs: StagePrograms | None = None):
        self.module = module
        self.loss_scale = float(loss_scale)
        self.programs = programs
        self._slices: dict[tuple[int, int], _Slice] = {}
        self._caches: dict[int, _Cache] = {}
        self._empty: dict[tuple[int, torch.device], list] = {}
        self._evaluated: dict[int, int] = {}  # forward-only: mb -> slices run so far
        self._pair_fn = None  # the program of two slices (`forward_pair`), made at its first use
        self._pair_programs: dict = {}  # with programs: (shapes, program) -> the two as one (`_paired`)

    # ------------------------------------------------------------------ forward

    def forward(self, mb: int, sl: int, x: torch.Tensor, offset: int, targets=None, checkpoint: bool = False,
                capacity: int | None = None, keep: list | None = None, documents=None):
        """Forward one slice; returns the detached activation to send (or the scaled loss).
        `capacity`: the micro-batch's token count, if known (sizes its KV buffers once); `keep`:
        per dropped unit of the stage, the slice's kept positions (random-LTD). `documents`:
        over packed documents, each row's document starts (the micro-batch's load); the slice
        reads only the cached tokens of its own documents, and sends gradients into no other
        (`StageModule.forward`)."""
        self._check_forward(mb, sl, 1)
        if self.module.is_last and targets is None:
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb} slice {sl}")
        if self.programs is not None:
            x = x.detach()
        elif not self.module.is_first:
            x = x.detach().requires_grad_(True)
        cache = self._caches.get(mb)
        start = cache.length if cache is not None else 0
        # the slice's tokens (a sequence-parallel stage's input activation holds 1/T of them)
        rec = _Slice(mb, x, int(offset), targets, start, x.size(1) * getattr(self.module, "token_parts", 1),
                     keep=keep, documents=documents)
        if keep is not None and self.programs is not None:
            raise RuntimeError(f"stage {self.module.lo}:{self.module.hi} runs its programs (a split backward "
                               "or --compile): random-LTD runs under eager autograd only")
        rec.starts = list(cache.filled) if cache is not None else [0] * self.module.num_kv
        if self.programs is not None:
            if documents is not None:
                raise RuntimeError("packed documents run eagerly: a stage's traced programs (--compile, a "
                                   "split backward) do not take document boundaries")
            y, kv = self._run_programs(rec, keep=not checkpoint, checkpoint=checkpoint)
        else:
            with torch.set_grad_enabled(not checkpoint):
                y, kv = self._run(rec, checkpoint)
        rec.lengths = [k.size(d) for k, d in zip(kv, self.module.kv_dims)]
        if documents is not None:  # the cache grows from its live documents (`_drop_finished`)
            self._append(mb, kv, None, rec.length)
            self._caches[mb].keep_all |= checkpoint
            self._drop_finished(mb, documents)
        else:
            self._append(mb, kv, capacity, rec.length)
        if not checkpoint and self.programs is None:
            rec.y, rec.kv_out = self._output(y), kv
        self._slices[(mb, sl)] = rec
        return self._scaled(y).detach()

    def _check_forward(self, mb: int, sl: int, count: int) -> None:
        """Slices sl .. sl + count - 1 of micro-batch `mb` have not run, and every earlier one has."""
        for i in range(sl, sl + count):
            if (mb, i) in self._slices:
                raise RuntimeError(f"forward of micro-batch {mb} slice {i} already ran on stage "
                                   f"{self.module.lo}:{self.module.hi}")
        for i in range(sl):
            if (mb, i) not in self._slices:
                raise RuntimeError(f"forward of micro-batch {mb} slice {sl} needs the KV cache of slice {i}, "
                                   f"whose forward has not run (or was freed) on stage {self.module.lo}:{self.module.hi}")

    def pairs(self) -> bool:
        """Whether two consecutive slices of this stage can run as one interleaved program
        (`forward_pair`): a tensor-parallel stage (whose collectives the pair overlaps) run
        eagerly or through its traced programs uncompiled (a compiled program is one kernel
        sequence of its own), every cached tensor whole (no window: a pair's cache is appended
        in place), no token dropping, no packed documents."""
        m = self.module
        compiled = self.programs is not None and self.programs.options.compile
        return (not compiled and getattr(m, "shards", None) is not None and not m.dropped
                and not m.documents and all(w is None for w in m.kv_windows))

    def backward_pairs(self) -> bool:
        """Whether the backwards of two consecutive slices can run as one program
        (`backward_pair`): a stage that pairs (`pairs`) run through its traced programs (an
        eager backward is one autograd call, which nothing can interleave)."""
        return self.programs is not None and self.pairs()

    def forward_pair(self, mb: int, sl: int, xs: tuple, offsets: tuple, targets: tuple, capacity: int):
        """Forward slices sl and sl + 1 of micro-batch `mb` as one program in which the
        collectives of each run while the other computes (`compiler/tensor/overlap.py`); the
        same values, caches and autograd graphs as `forward` twice. Returns the two detached
        activations to send (or scaled losses)."""
        self._check_forward(mb, sl, 2)
        if self.programs is not None:
            return self._program_pair(mb, sl, xs, offsets, targets, capacity, grad=True)
        xs = tuple(x if self.module.is_first else x.detach().requires_grad_(True) for x in xs)
        a, b, outs, sink = self._run_pair(mb, xs, offsets, targets, capacity, grad=True)
        n = self.module.num_kv
        ya, kva, yb, kvb = outs[0], list(outs[1:1 + n]), outs[1 + n], list(outs[2 + n:])
        b.starts, b.prefix = list(sink.starts), sink.leaves
        self._append(mb, kvb, capacity, b.length)
        for rec, y, kv in ((a, ya, kva), (b, yb, kvb)):
            rec.lengths = [k.size(d) for k, d in zip(kv, self.module.kv_dims)]
            rec.y, rec.kv_out = self._output(y), kv
        self._slices[(mb, sl)], self._slices[(mb, sl + 1)] = a, b
        return self._scaled(ya).detach(), self._scaled(yb).detach()

    def evaluate_pair(self, mb: int, sl: int, xs: tuple, offsets: tuple, targets: tuple, capacity: int):
        """`evaluate` of slices sl and sl + 1 as one program (`forward_pair`, no autograd)."""
        done = self._evaluated.get(mb, 0)
        if sl != done:
            raise RuntimeError(f"forward of micro-batch {mb} slice {sl} needs the KV cache of slices "
                               f"0..{sl - 1}; {done} have run on stage {self.module.lo}:{self.module.hi}")
        if self.programs is not None:
            out = self._program_pair(mb, sl, xs, offsets, targets, capacity, grad=False)
            self._evaluated[mb] = sl + 2
            return out
        with torch.no_grad():
            a, b, outs, _ = self._run_pair(mb, xs, offsets, targets, capacity, grad=False)
            n = self.module.num_kv
            self._append(mb, list(outs[2 + n:]), capacity, b.length)
        self._evaluated[mb] = sl + 2
        return self._scaled(outs[0]), self._scaled(outs[1 + n])

    def _run_pair(self, mb: int, xs: tuple, offsets: tuple, targets: tuple, capacity: int, grad: bool):
        """The program of two slices (`forward_pair`): their records, its outputs (a's, then
        b's: y and the cached tensors each) and the cache it wrote a's tensors to. a's tensors
        are in the micro-batch's cache when it returns; b's are not."""
        if not self.pairs():
            raise RuntimeError(f"stage {self.module.lo}:{self.module.hi} cannot run two slices as one program")
        if self.module.is_last and any(t is None for t in targets):
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb}")
        if self._pair_fn is None:
            from tpc.compiler.frontend.stage import graph_function
            from tpc.compiler.tensor.overlap import paired_program

            m = self.module
            self._pair_fn, _ = graph_function(paired_program(m.graph, m.num_kv),
                                              f"<tpc stage {m.lo}:{m.hi}, two slices>")
        parts = getattr(self.module, "token_parts", 1)
        if mb not in self._caches:
            n = self.module.num_kv
            self._caches[mb] = _Cache([None] * n, 0, base=[0] * n, filled=[0] * n)
        cache = self._caches[mb]
        a = _Slice(mb, xs[0], int(offsets[0]), targets[0], cache.length, xs[0].size(1) * parts)
        b = _Slice(mb, xs[1], int(offsets[1]), targets[1], cache.length + a.length, xs[1].size(1) * parts)
        a.starts = list(cache.filled)
        if not a.start:
            a.prefix, prefix = [], self._empty_kv(a.x.size(0), a.x.device)
        elif grad:
            a.prefix = prefix = [_leaf(p) for p in self._prefix(a)]
        else:
            prefix = self._prefix(a)
        sink = _PairCache(self, mb, capacity, leaves=grad)
        loss = self.module.has_loss
        args = [a.x, a.offset, *prefix, *([a.targets] if loss else []), b.x, b.offset, *([b.targets] if loss else []),
                sink]
        with torch.set_grad_enabled(grad):
            outs = self._pair_fn(self.module, *args)
        cache.length += a.length
        return a, b, outs, sink

    def _program_pair(self, mb: int, sl: int, xs: tuple, offsets: tuple, targets: tuple, capacity: int,
                      grad: bool):
        """`forward_pair` (`grad`) or `evaluate_pair` through the stage's programs: the forward
        programs of the two slices' shapes as one (`overlap.paired_programs`), a's cached
        tensors handed to b's prefix through the cache. Returns the two outputs to send (or
        scaled losses)."""
        if not self.pairs():
            raise RuntimeError(f"stage {self.module.lo}:{self.module.hi} cannot run two slices as one program")
        if capacity is None:
            raise RuntimeError("a pair of programs needs the micro-batch's length (its cache is sized once)")
        m, n = self.module, self.module.num_kv
        if m.is_last and any(t is None for t in targets):
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb}")
        if mb not in self._caches:
            self._caches[mb] = _Cache([None] * n, 0, base=[0] * n, filled=[0] * n)
        cache = self._caches[mb]
        parts = getattr(m, "token_parts", 1)
        (xa, xb), (ta, tb) = (_dense(x.detach()) for x in xs), (_dense(t) for t in targets)
        a = _Slice(mb, xa, int(offsets[0]), ta, cache.length, xa.size(1) * parts)
        b = _Slice(mb, xb, int(offsets[1]), tb, cache.length + a.length, xb.size(1) * parts)
        a.starts = list(cache.filled)
        prefix_a = self._prefix(a)
        pa = self.programs.get(Shape.of(xa, a.offset, prefix_a, m.kv_dims, grad=grad), xa, prefix_a, ta)
        # room for a's cached tensors now, so that b's prefix is the view it will be after a's
        # write (its shape and layout choose b's programs)
        outs_a = pa.graphs["forward"].graph.output_node().args[0]
        kv_a = [o.meta["val"] for o in outs_a[1:1 + n]]
        for t, v in enumerate(kv_a):
            self._reserve(cache, t, v.shape, v.dtype, xa.device, capacity)
        prefix_b = [self._prefix_view(cache, t, cache.filled[t] + v.shape[d])
                    for t, (v, d) in enumerate(zip(kv_a, m.kv_dims))]
        pb = self.programs.get(Shape.of(xb, b.offset, prefix_b, m.kv_dims, grad=grad), xb, prefix_b, tb)
        state = self.programs.state()
        fn = self._paired(pa, pb, "forward", [(t, 1 + t, len(state) + 1 + t) for t in range(n)])
        ins_a = [*state, xa, *prefix_a, *([] if ta is None else [ta])]
        sink = _PairCache(self, mb, capacity, leaves=False)
        with torch.no_grad():
            outs = fn(*ins_a, *state, xb, *([] if tb is None else [tb]), sink)
        cache.length += a.length
        na = len(outs_a)
        ya, kva, yb, kvb = outs[0], list(outs[1:1 + n]), outs[na], list(outs[na + 1:na + 1 + n])
        b.starts = list(sink.starts)
        self._append(mb, kvb, capacity, b.length)
        if grad:
            ins_b = [*state, xb, *sink.leaves, *([] if tb is None else [tb])]
            for rec, progs, ins, y, kv, computed in ((a, pa, ins_a, ya, kva, outs[1 + n:na]),
                                                      (b, pb, ins_b, yb, kvb, outs[na + 1 + n:])):
                rec.programs = progs
                rec.values = [ins[i] for i in progs.saved_inputs] + list(computed)
                rec.kv_meta = [(k.shape, k.dtype) for k in kv]
                rec.y_meta = (y.shape, y.dtype)
                rec.lengths = [k.size(d) for k, d in zip(kv, m.kv_dims)]
            self._slices[(mb, sl)], self._slices[(mb, sl + 1)] = a, b
        return self._scaled(ya).detach(), self._scaled(yb).detach()

    def _paired(self, first: Programs, second: Programs, name: str, handover: list, tags=("a", "b")):
        """The program `name` of two shapes run as one (`overlap.paired_programs`), made once."""
        key = (first.shape, second.shape, name, tuple(handover))
        fn = self._pair_programs.get(key)
        if fn is None:
            from tpc.compiler.tensor.overlap import paired_programs

            fn = self._pair_programs[key] = paired_programs(first.graphs[name], second.graphs[name], handover,
                                                            tags=tags)
        return fn

    def evaluate(self, mb: int, sl: int, x: torch.Tensor, offset: int, targets=None,
                 capacity: int | None = None, documents=None) -> torch.Tensor:
        """Forward one slice with no autograd graph and nothing kept but the KV cache the next
        slice reads (the evaluation program); returns the activation (or the scaled loss)."""
        done = self._evaluated.get(mb, 0)
        if sl != done:
            raise RuntimeError(f"forward of micro-batch {mb} slice {sl} needs the KV cache of slices "
                               f"0..{sl - 1}; {done} have run on stage {self.module.lo}:{self.module.hi}")
        if self.module.is_last and targets is None:
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb} slice {sl}")
        cache = self._caches.get(mb)
        start = cache.length if cache is not None else 0
        with torch.no_grad():
            if start == 0:
                prefix = self._empty_kv(x.size(0), x.device)
            else:
                prefix = [self._prefix_view(cache, t, cache.filled[t]) for t in range(len(cache.kv))]
            if self.programs is not None and documents is None:
                y, kv = self._forward_program(x, int(offset), prefix, targets)
            elif documents is not None:
                y, kv = self.module(x, int(offset), prefix, targets, documents=documents)
            else:
                y, kv = self.module(x, int(offset), prefix, targets)
            self._append(mb, kv, None if documents is not None else capacity,
                         x.size(1) * getattr(self.module, "token_parts", 1))
            if documents is not None:
                self._drop_finished(mb, documents)
        self._evaluated[mb] = sl + 1
        return self._scaled(y)

    def recompute(self, mb: int, sl: int) -> None:
        """Rebuild the autograd graph of a checkpointed forward (same inputs, same cached prefix)."""
        rec = self._get(mb, sl, "recompute")
        if rec.y is not None or rec.values is not None:
            raise RuntimeError(f"recompute of micro-batch {mb} slice {sl}: its graph is already held")
        if self.programs is not None:
            self._run_programs(rec, keep=True)
            return
        with torch.enable_grad():
            y, rec.kv_out = self._run(rec)
        rec.y = self._output(y)

    def _output(self, y: torch.Tensor):
        """What a slice keeps of its output for its backward: the loss on the last stage, else
        the output's gradient edge (autograd needs no more to run backward from it; the
        activation's bytes go with its send)."""
        if self.module.is_last or not y.requires_grad:
            return y
        return torch.autograd.graph.get_gradient_edge(y)

    def _prefix(self, rec: _Slice, checkpoint: bool = False) -> list:
        """The cached tokens a slice reads: views of the cache (the empty caches of a first
        slice); a windowed cache's last w - 1 tokens only. A checkpointed slice keeps copies of
        its windowed prefixes, which later slices may overwrite before it is recomputed."""
        if rec.start == 0:
            return self._empty_kv(rec.x.size(0), rec.x.device)
        cache = self._caches[rec.mb]
        if rec.window_copies is not None:  # a recompute: the windowed prefixes may have been overwritten
            return [copy if copy is not None else self._prefix_view(cache, t, rec.starts[t])
                    for t, copy in enumerate(rec.window_copies)]
        prefix = [self._prefix_view(cache, t, rec.starts[t]) for t in range(len(cache.kv))]
        if checkpoint and any(w is not None for w in self.module.kv_windows):
            rec.window_copies = [p.detach().clone() if w is not None else None
                                 for p, w in zip(prefix, self.module.kv_windows)]
        return prefix

    def _run(self, rec: _Slice, checkpoint: bool = False):
        """The module on one slice under autograd, its prefix read as leaves viewing the cache.
        Over packed documents a slice at whose first token every row starts a document reads no
        cached token: it gets the empty prefix of a first slice, holds no view of the cache and
        sends the earlier slices no gradient."""
        if rec.documents is not None and rec.start > 0 and all(rec.start in row for row in rec.documents):
            rec.prefix = []
            return self.module(rec.x, rec.offset, self._empty_kv(rec.x.size(0), rec.x.device), rec.targets,
                               documents=rec.documents)
        prefix = self._prefix(rec, checkpoint)
        if rec.start == 0:
            rec.prefix = []
        elif rec.documents is not None:
            # copies of the live documents' tokens, not views: a view would keep the whole buffer,
            # finished documents included, alive until this slice's backward
            rec.prefix = prefix = [_leaf(p.clone()) for p in prefix]
        else:
            rec.prefix = prefix = [_leaf(p) for p in prefix]
        if rec.keep is not None:
            return self.module(rec.x, rec.offset, prefix, rec.targets, keep=rec.keep)
        if rec.documents is not None:
            return self.module(rec.x, rec.offset, prefix, rec.targets, documents=rec.documents)
        return self.module(rec.x, rec.offset, prefix, rec.targets)

    def _forward_program(self, x, offset: int, prefix: list, targets):
        """A slice's forward through the forward-only program of its shape (evaluation)."""
        x, targets = _dense(x), _dense(targets)
        progs = self.programs.get(Shape.of(x, offset, prefix, self.module.kv_dims, grad=False), x, prefix, targets)
        outs = progs.forward(*self.programs.state(), x, *prefix, *([] if targets is None else [targets]))
        return outs[0], list(outs[1:])

    def _run_programs(self, rec: _Slice, keep: bool, checkpoint: bool = False):
        """The forward program of the slice's shape; keeps what its backward reads (`keep`)."""
        prefix = self._prefix(rec, checkpoint)
        x, targets = _dense(rec.x), _dense(rec.targets)
        progs = self.programs.get(Shape.of(x, rec.offset, prefix, self.module.kv_dims), x, prefix, targets)
        inputs = [*self.programs.state(), x, *prefix, *([] if targets is None else [targets])]
        with torch.no_grad():
            outs = progs.forward(*inputs)
        n = self.module.num_kv
        y, kv = outs[0], list(outs[1:1 + n])
        rec.programs = progs
        # what the backward reads: the inputs it needs (held here, not returned by the program),
        # then what the forward computed for it
        rec.values = [inputs[i] for i in progs.saved_inputs] + list(outs[1 + n:]) if keep else None
        rec.kv_meta = [(k.shape, k.dtype) for k in kv]
        rec.y_meta = (y.shape, y.dtype)
        return y, kv

    def _prefix_view(self, cache: _Cache, t: int, start: int) -> torch.Tensor:
        """Tokens [start - p, start) of cached tensor t: p = start, or at most w - 1 for a window."""
        w, d = self.module.kv_windows[t], self.module.kv_dims[t]
        # (a full cache over packed documents holds the tokens from its first live document on)
        p = start - cache.base[t] if w is None else min(start, w - 1)
        return cache.kv[t].narrow(d, start - p - cache.base[t], p)

    def _drop_finished(self, mb: int, documents) -> None:
        """Over packed documents: drop from micro-batch `mb`'s full caches the tokens of documents
        no later slice reads, those before the document every row's next token is in. The live
        tokens move to a new buffer of their own (never in place: a slice's saved keys may be
        the old buffer); the old one goes with its last reader. Not after a checkpointed slice,
        whose recompute reads its prefix again."""
        cache = self._caches[mb]
        if cache.keep_all:
            return
        nxt = cache.length
        live = min(max(s for s in row if s <= nxt) for row in documents)
        for t, (d, w) in enumerate(zip(self.module.kv_dims, self.module.kv_windows)):
            if w is not None or live <= cache.base[t]:
                continue
            buf = cache.kv[t]
            cache.kv[t] = buf.narrow(d, live - cache.base[t], nxt - live).clone()
            cache.base[t] = live

    def _append(self, mb: int, kv: list, capacity: int | None, tokens: int) -> None:
        """Write a slice's keys/values after the cached ones: into buffers of the micro-batch's
        whole length when `capacity` is known, else into buffers that grow by doubling; a
        windowed tensor into a buffer of its last w - 1 tokens plus the slice. `tokens`: the
        slice's length (a dropped unit's tensors hold fewer: their kept tokens)."""
        cache = self._caches.get(mb)
        if cache is None:
            bufs = []
            for k, d, w in zip(kv, self.module.kv_dims, self.module.kv_windows):
                n = k.size(d)
                size = capacity if capacity is not None and capacity > n else n
                if w is not None:  # a buffer of its own: it is overwritten in place when full
                    size = max(n, min(size, w - 1 + n) if capacity is not None else w - 1 + n)
                if size <= n and w is None:  # its own tensor starts the buffer (no copy)
                    bufs.append(k.detach())
                else:
                    buf = k.new_empty(k.shape[:d] + (size,) + k.shape[d + 1:])
                    buf.narrow(d, 0, n).copy_(k.detach())
                    bufs.append(buf)
            self._caches[mb] = _Cache(bufs, tokens, base=[0] * len(bufs),
                                      filled=[k.size(d) for k, d in zip(kv, self.module.kv_dims)])
            return
        for t, k in enumerate(kv):
            self._append_one(cache, t, k, capacity)
        cache.length += tokens

    def _append_one(self, cache: _Cache, t: int, k: torch.Tensor, capacity: int | None) -> None:
        """Write cached tensor t of a slice after its cached tokens (`_append`)."""
        d, w = self.module.kv_dims[t], self.module.kv_windows[t]
        n = k.size(d)
        self._reserve(cache, t, k.shape, k.dtype, k.device, capacity)
        buf, filled = cache.kv[t], cache.filled[t] - cache.base[t]
        if buf.size(d) < filled + n:
            if w is not None:  # windowed: keep the last w - 1 tokens, at the front
                m = min(cache.filled[t], w - 1)
                tail = buf.narrow(d, filled - m, m).clone()
                if buf.size(d) < m + n:
                    cache.kv[t] = buf = buf.new_empty(buf.shape[:d] + (m + n,) + buf.shape[d + 1:])
                buf.narrow(d, 0, m).copy_(tail)
                cache.base[t], filled = cache.filled[t] - m, m
        buf.narrow(d, filled, n).copy_(k.detach())
        cache.filled[t] += n

    def _reserve(self, cache: _Cache, t: int, shape, dtype, device, capacity: int | None) -> None:
        """Make room in cached tensor t's buffer for a slice's tensor of `shape`, as writing it
        (`_append_one`) needs: the first slice of a pair has no buffer yet (one of `capacity`
        tokens, or of its own); a full cache's buffer too small for it grows to twice its
        size. A pair of programs (`forward_pair`) reserves before its first slice runs, so
        that the second slice's prefix is the view it would be after the first's write."""
        d, w = self.module.kv_dims[t], self.module.kv_windows[t]
        n = shape[d]
        if cache.kv[t] is None:
            size = capacity if capacity is not None and capacity > n else n
            cache.kv[t] = torch.empty(tuple(shape[:d]) + (size,) + tuple(shape[d + 1:]), dtype=dtype, device=device)
            return
        buf, filled = cache.kv[t], cache.filled[t] - cache.base[t]
        if w is None and buf.size(d) < filled + n:  # full: a buffer twice as large
            grown = buf.new_empty(buf.shape[:d] + (max(2 * buf.size(d), filled + n),) + buf.shape[d + 1:])
            grown.narrow(d, 0, filled).copy_(buf.narrow(d, 0, filled))
            cache.kv[t] = grown

    def _empty_kv(self, batch: int, device: torch.device) -> list:
        """The zero-length caches of a first slice, made once per batch size: building them
        evaluates the cache shapes symbolically, milliseconds per slice otherwise. They hold
        no data and never require grad, so every first slice can share them."""
        key = (batch, device)
        if key not in self._empty:
            self._empty[key] = self.module.empty_kv(batch)
        return self._empty[key]

    def _scaled(self, y):
        return y * self.loss_scale if self.module.is_last else y

    # ------------------------------------------------------------------ backward

    def _upstream(self, mb: int, sl: int, rec: _Slice, grad_out):
        """Outputs and their upstream gradients: [y, k..., v...] (K/V only where later slices
        sent gradients into them)."""
        if rec.y is None:
            raise RuntimeError(f"backward of micro-batch {mb} slice {sl}: its forward was checkpointed; "
                               "recompute it first")
        if self.module.is_last:
            outs, grads = [self._scaled(rec.y)], [torch.ones_like(rec.y) if grad_out is None else grad_out]
        else:
            if grad_out is None:
                raise RuntimeError(f"backward of micro-batch {mb} slice {sl} needs the output gradient")
            outs, grads = [rec.y], [grad_out]
        for out, g in zip(rec.kv_out, self._kv_grads(mb, sl, rec)):
            if g is not None:
                outs.append(out)
                grads.append(g)
        return outs, grads

    def _kv_grads(self, mb: int, sl: int, rec: _Slice) -> list:
        """Per cached tensor, the gradients later slices sent into this slice's tokens of it
        (None: none did)."""
        later = self._slices.get((mb, sl + 1))
        if later is not None and not later.sent_kv_grads:
            raise RuntimeError(f"backward of micro-batch {mb} slice {sl} needs the backward of slice {sl + 1} first "
                               "(its gradients into this slice's keys and values)")
        cache = self._caches[mb]
        return [self._kv_grad(cache, t, rec) for t in range(len(self.module.kv_dims))]

    def _kv_grad(self, cache: _Cache, t: int, rec: _Slice):
        """The gradients the backwards run so far sent into this slice's tokens of cached tensor
        t (None: none did)."""
        d = self.module.kv_dims[t]
        acc = cache.grad[t] if cache.grad is not None else None
        start, length = rec.starts[t], rec.lengths[t]
        lo = max(start, acc.base) if acc is not None else 0
        hi = min(start + length, acc.base + acc.g.size(d)) if acc is not None else 0
        if acc is None or lo >= hi:  # no later slice read these tokens
            return None
        part = acc.g.narrow(d, lo - acc.base, hi - lo)
        if hi - lo < length:  # a windowed cache: later slices read only its last tokens
            shape = list(part.shape)
            shape[d] = length
            g = part.new_zeros(shape)
            g.narrow(d, lo - start, hi - lo).copy_(part)
            part = g
        return part

    def _tangents(self, mb: int, sl: int, rec: _Slice, grad_out) -> list:
        """The upstream gradients of every output of the slice's programs: y's (the loss scale
        on the last stage), then each cached tensor's (zeros where no later slice sent any)."""
        if rec.values is None:
            raise RuntimeError(f"backward of micro-batch {mb} slice {sl}: its forward was checkpointed; "
                               "recompute it first")
        out = [self._y_tangent(mb, sl, rec, grad_out)]
        for t, part in enumerate(self._kv_grads(mb, sl, rec)):
            out.append(self._kv_tangent(rec, t, part))
        return out

    def _y_tangent(self, mb: int, sl: int, rec: _Slice, grad_out) -> torch.Tensor:
        """The upstream gradient of the slice's output y (`_tangents`)."""
        shape, dtype = rec.y_meta
        if self.module.is_last:
            g = torch.ones(shape, dtype=dtype, device=rec.x.device) if grad_out is None else grad_out
            g = g * self.loss_scale
        else:
            if grad_out is None:
                raise RuntimeError(f"backward of micro-batch {mb} slice {sl} needs the output gradient")
            g = grad_out
        return g.to(dtype).contiguous()  # the programs take them contiguous (joint.py)

    def _kv_tangent(self, rec: _Slice, t: int, part) -> torch.Tensor:
        """The upstream gradient of the slice's cached tensor t, from `part` (`_kv_grad`)."""
        kv_shape, kv_dtype = rec.kv_meta[t]
        if part is None:
            return torch.zeros(kv_shape, dtype=kv_dtype, device=rec.x.device)
        return part.to(kv_dtype).contiguous()

    def _input_grad(self, rec: _Slice):
        """The slice's input gradient, to send (None on stage 0); the record lets go of it, so
        that it goes with its send rather than staying until `free-kv`."""
        if self.module.is_first:
            return None
        g, rec.x.grad = rec.x.grad, None
        return g

    def _send_prefix_grads(self, rec: _Slice, grads: list | None = None) -> None:
        """Add the gradients this slice's backward sent into its prefix (`grads`, per cached
        tensor, with programs; else what autograd left in its prefix leaves) to the cache's
        gradients, where the earlier slices find theirs."""
        if rec.start > 0 and (grads is not None or rec.prefix):  # (a slice that read no prefix sends nothing)
            cache = self._caches[rec.mb]
            if cache.grad is None:
                cache.grad = [None] * len(cache.kv)
            for t, (d, w) in enumerate(zip(self.module.kv_dims, self.module.kv_windows)):
                if grads is not None:
                    if cache.kv[t].is_floating_point():  # (not a cache of token ids)
                        self._send_prefix_grad(rec, t, grads[t])
                    continue
                leaf = rec.prefix[t]
                if not leaf.requires_grad:  # a cache of token ids
                    continue
                g, leaf.grad = leaf.grad, None
                # added in: the graph a split backward keeps for its weight half holds the leaf,
                # whose gradient is a view of all of the attention's key gradient. A full cache's
                # gradients cover [0, start) from the first backward on; over packed documents
                # only the regions slices read (their live documents), as a window's
                full = w is None and rec.documents is None
                cache.grad[t] = self._accumulate(cache.grad[t], g, leaf.shape, leaf.dtype, d, rec.starts[t], full)
        rec.prefix = []
        rec.sent_kv_grads = True

    def _send_prefix_grad(self, rec: _Slice, t: int, grad) -> None:
        """Add the gradient a slice's program sent into its prefix of cached tensor t (None:
        nothing) to the cache's gradients (`_send_prefix_grads`)."""
        cache = self._caches[rec.mb]
        if cache.grad is None:
            cache.grad = [None] * len(cache.kv)
        d, w = self.module.kv_dims[t], self.module.kv_windows[t]
        p = rec.programs.shape.prefix[t]
        shape = cache.kv[t].shape[:d] + (p,) + cache.kv[t].shape[d + 1:]
        full = w is None and rec.documents is None
        cache.grad[t] = self._accumulate(cache.grad[t], grad, shape, cache.kv[t].dtype, d, rec.starts[t], full)

    @staticmethod
    def _accumulate(acc: _Acc | None, grad, shape, dtype, d: int, start: int, full: bool) -> _Acc | None:
        """The gradients of a cached tensor after a slice whose prefix of it (`shape`: tokens
        [start - p, start)) received `grad` (None: nothing). Summed in fp32 at least: under bf16
        autocast the cache is bf16, and each later slice adds into the gradients of every
        earlier slice's keys/values.

        A full cache's first backward (the last slice's: nothing sends gradients into the last
        slice's keys) allocates tokens [0, start), which covers every earlier slice. A windowed
        one keeps only tokens that no backward has consumed yet: [start - p, start) and what is
        left below `start` of the previous region."""
        p = shape[d]
        dtype = torch.promote_types(dtype, torch.float32)
        if full:
            if acc is None:
                acc = _Acc(torch.zeros(shape, dtype=dtype, device=grad.device if grad is not None else None), 0)
            if grad is not None:
                acc.g.narrow(d, start - p, p).add_(grad)
            return acc
        lo = start - p if acc is None else min(start - p, acc.base)
        device = acc.g.device if acc is not None else (grad.device if grad is not None else None)
        g = torch.zeros((*shape[:d], start - lo, *shape[d + 1:]), dtype=dtype, device=device)
        if acc is not None:
            keep = min(start, acc.base + acc.g.size(d)) - acc.base
            if keep > 0:
                g.narrow(d, acc.base - lo, keep).add_(acc.g.narrow(d, 0, keep))
        if grad is not None:
            g.narrow(d, start - p - lo, p).add_(grad)
        return _Acc(g, lo)

    def backward(self, mb: int, sl: int, grad_out=None):
        """Input and weight gradients of one slice; returns the input gradient (None on stage 0)."""
        rec = self._get(mb, sl, "backward")
        if self.programs is not None:
            with torch.no_grad():
                got = rec.programs.backward(*rec.values, *self._tangents(mb, sl, rec, grad_out))
            rec.values = None
            n = len(rec.programs.input_grads)
            self._add_param_grads(got[n:])
            return self._take_input_grads(rec, got[:n])
        outs, grads = self._upstream(mb, sl, rec, grad_out)
        torch.autograd.backward(outs, grads)
        self._send_prefix_grads(rec)
        rec.y, rec.kv_out = None, []
        return self._input_grad(rec)

    def backward_input(self, mb: int, sl: int, grad_out=None):
        """Split backward, first half: gradients of the input and of the cached prefix (what the
        previous stage and the earlier slices wait for). What the weight half needs is held
        for backward_weight (the stage's programs: `tpc.compiler.programs.joint`)."""
        rec = self._get(mb, sl, "backward-input")
        if self.programs is None:
            raise RuntimeError(f"backward-input of micro-batch {mb} slice {sl} on stage {self.module.lo}:"
                               f"{self.module.hi}: a split backward runs the stage's programs; this stage "
                               "was built without them")
        with torch.no_grad():
            got = rec.programs.backward_input(*rec.values, *self._tangents(mb, sl, rec, grad_out))
        n = len(rec.programs.input_grads)
        self._hold(rec, got[n:])
        rec.values = None
        return self._take_input_grads(rec, got[:n])

    def backward_pair(self, mb: int, sl: int, grads_out: tuple, whole: bool = True) -> tuple:
        """`backward` (`whole`) or `backward_input` of slices sl and then sl - 1 as one program,
        in which the collectives of each run while the other computes (`overlap.py`): slice
        sl's gradient into its prefix goes into the cache as soon as a layer has computed it,
        and slice sl - 1's backward of that layer reads its upstream gradient from there. The
        same values as the two run one after the other. Returns their input gradients (to
        send; None on stage 0), sl's first."""
        what = "backward" if whole else "backward-input"
        b, a = self._get(mb, sl, what), self._get(mb, sl - 1, what)
        if not self.backward_pairs():
            raise RuntimeError(f"stage {self.module.lo}:{self.module.hi} cannot run two backwards as one program")
        for rec, i in ((b, sl), (a, sl - 1)):
            if rec.values is None:
                raise RuntimeError(f"{what} of micro-batch {mb} slice {i}: its forward was checkpointed; "
                                   "recompute it first")
        cache = self._caches[mb]
        tangents_b = self._tangents(mb, sl, b, grads_out[0])
        name = "backward" if whole else "backward_input"
        # b's gradient of its prefix t (its input 1 + t) is a's upstream gradient of cached tensor t
        # (a's input after its saved values and y's gradient)
        handover = [(i - 1, j, len(a.values) + i) for j, i in enumerate(b.programs.input_grads)
                    if i > 0 and cache.kv[i - 1].is_floating_point()]
        handed = {t for t, _, _ in handover}
        rest = [self._kv_tangent(a, t, self._kv_grad(cache, t, a)) for t in range(self.module.num_kv)
                if t not in handed]
        fn = self._paired(b.programs, a.programs, name, handover, tags=("b", "a"))
        sink = _GradPair(self, b, a)
        with torch.no_grad():
            outs = fn(*b.values, *tangents_b, *a.values, self._y_tangent(mb, sl - 1, a, grads_out[1]), *rest, sink)
        nb = len(b.programs.graphs[name].graph.output_node().args[0])
        got = []
        for rec, part in ((b, outs[:nb]), (a, outs[nb:])):
            k = len(rec.programs.input_grads)
            if whole:
                self._add_param_grads(part[k:])
            else:
                self._hold(rec, part[k:])
            rec.values = None
            if rec is b:  # its prefix gradients went into the cache as the program ran
                rec.prefix, rec.sent_kv_grads = [], True
                x = [g for i, g in zip(rec.programs.input_grads, part[:k]) if i == 0]
                got.append(None if self.module.is_first or not x else x[0])
            else:
                got.append(self._take_input_grads(rec, part[:k]))
        return tuple(got)

    def _hold(self, rec: _Slice, held) -> None:
        """Keep what a slice's backward_input computed for its backward_weight (`held_bytes`)."""
        rec.held = list(held)
        stash = {storage_key(t) for t in rec.values if isinstance(t, torch.Tensor)}
        made = {storage_key(t): t.untyped_storage().nbytes() for t in rec.held if isinstance(t, torch.Tensor)}
        rec.held_bytes = int(sum(b for k, b in made.items() if k not in stash))

    def _take_input_grads(self, rec: _Slice, grads) -> torch.Tensor | None:
        """Hand a program's input gradients on: the prefixes' into the cache, x's returned."""
        by_input: list = [None] * (1 + self.module.num_kv)
        for i, g in zip(rec.programs.input_grads, grads):
            by_input[i] = g
        self._send_prefix_grads(rec, by_input[1:])
        return None if self.module.is_first else by_input[0]

    def _add_param_grads(self, grads) -> None:
        """Accumulate a program's parameter gradients into `.grad`, as autograd does: the first
        into a buffer of the parameter's own (a program's output may share storage with what it
        read), later ones added in place, all in one foreach call (one dispatch, not one a
        parameter)."""
        into, add = [], []
        for p, g in zip(self.programs.trainable(), grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(g)
            else:
                into.append(p.grad)
                add.append(g)
        if into:
            torch._foreach_add_(into, add)

    def held_bytes(self, mb: int, sl: int) -> int:
        """What the slice's backward_input computed and keeps for its backward_weight (0 before
        or after), each storage once: the gradients the weight half starts from. What it keeps
        of the forward's saved values (the linear layers' inputs) is counted with the forward's
        stash, as the memory model does."""
        rec = self._slices.get((mb, sl))
        return 0 if rec is None or rec.held is None else rec.held_bytes

    def backward_weight(self, mb: int, sl: int) -> None:
        """Split backward, second half: parameter gradients, accumulated into .grad."""
        rec = self._slices.get((mb, sl))
        if rec is None or rec.held is None:
            raise RuntimeError(f"backward-weight of micro-batch {mb} slice {sl} needs its backward-input first")
        with torch.no_grad():
            got = rec.programs.backward_weight(*rec.held)
        rec.held = None
        self._add_param_grads(got)

    def _get(self, mb: int, sl: int, what: str) -> _Slice:
        rec = self._slices.get((mb, sl))
        if rec is None:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl} on stage {self.module.lo}:{self.module.hi}: "
                               "its forward has not run (or its KV cache was freed)")
        if rec.sent_kv_grads:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl}: its backward already ran")
        return rec

    # ------------------------------------------------------------------ memory

    def kv_buffers(self, mb: int) -> list:
        """The buffers holding micro-batch `mb`'s cached keys/values on this stage (their first
        tokens are filled; a buffer is replaced by a larger one when it grows)."""
        cache = self._caches.get(mb)
        return list(cache.kv) if cache is not None else []

    def free_kv(self, mb: int) -> None:
        """Drop every slice of a micro-batch: KV caches, their gradients, saved inputs."""
        for key in [k for k in self._slices if k[0] == mb]:
            del self._slices[key]
        self._caches.pop(mb, None)
        self._evaluated.pop(mb, None)

    @property
    def live_activations(self) -> int:
        """Slices whose autograd graph (or saved values) is currently held."""
        return sum(1 for r in self._slices.values() if r.y is not None or r.values is not None)
