"""The optimizer of one rank with its state sharded over the data-parallel group (ZeRO-1,
`tpc run --shard-optimizer`).

Without sharding every data-parallel replica of a pipeline rank keeps the whole AdamW state of
its stages (two fp32 moments: 8 bytes a parameter) and takes the same step. Sharded, each
stage's gradients live in one flat buffer, padded to a multiple of the data-parallel size d and
cut into d equal chunks; replica r owns chunk r:

    allreduce stage S  ->  reduce-scatter: chunk r of the buffer holds the summed gradients
    step               ->  AdamW on the owned chunk only (its state: 8/d bytes a parameter),
                           written into the parameters' own storage; then an all-gather of the
                           chunks (through the same buffer) gives every replica every weight

A chunk cuts parameters anywhere: what the optimizer steps are the `pieces`, 1-D views of the
parameters' storage, with views of the buffer as their gradients. AdamW's arithmetic is per
element and its hyperparameters (decay on matrices only) per parameter, so stepping pieces is
stepping the parameters; the gradients are the same sums (the gloo and NCCL reduce-scatter add
what the allreduce adds), so a sharded run follows the unsharded one (tests: within 1e-6 over 50
steps).

Kept whole (every replica holds their whole state, reduced by the transport's allreduce as
without sharding): the parameters of a stage with weight replicas (chimera) and a tie held by
several pipeline ranks. Their gradients are summed over pipeline ranks after the data-parallel
reduction (`reduce-replicas`, `reduce-tied`), which needs the whole data-parallel sum on every
rank, and two ranks would lay the tie out in their buffers differently.

The global gradient norm (clipping, metrics) counts each element once: a rank adds the squares
of its chunks, plus those of its whole parameters on data rank 0 only; the sum runs over the
pipeline and then the data-parallel group, on the device (no host read: the step reads it once,
with the loss). The gradients a run keeps for checks (`--verify-grads`) are gathered from the
chunks.

Checkpoints store each rank's part of a parameter's state under the parameter's key, as the
rectangles DCP writes (`shard_pieces.Pieces`); a run of any data-parallel size, sharded or not,
reads its own parts back. The weights stay fp32 (bf16 runs autocast the compute), so there is
no master copy to shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from tpc.executors.training.optimizer import OptimSpec
from tpc.executors.training.param_groups import unique_parameters
from tpc.executors.training.shard_pieces import Part, Pieces
from tpc.ir.diagnostics import Diagnostic, TpirError


@dataclass
class Piece:
    """The elements [lo, hi) of parameter `name` (offsets in the parameter), owned by this rank."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    view: torch.Tensor  # a 1-D view of the parameter's storage: what AdamW steps


@dataclass
class Bucket:
    """One stage's sharded parameters in one flat gradient buffer of `size` elements (padded to
    a multiple of the data-parallel size); this rank owns [lo, hi)."""

    stage: int
    params: list[tuple[str, torch.nn.Parameter]]
    offsets: list[int]
    size: int
    lo: int
    hi: int
    flat: torch.Tensor
    pieces: list[Piece] = field(default_factory=list)

    @property
    def owned(self) -> torch.Tensor:
        return self.flat[self.lo:self.hi]

    def adopt_grads(self) -> None:
        """Make the parameters' gradients views of the buffer (copying in any gradient that is
        not one yet, zeros where backward left none): backward then accumulates in place."""
        for (_, p), o in zip(self.params, self.offsets):
            view = self.flat[o:o + p.numel()].view_as(p)
            g = p.grad
            if g is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view


class ShardedOptimizer:
    """AdamW (or SGD) over this rank's chunks of its stages' parameters; see the module
    docstring. `stages`: stage -> its (name, parameter) pairs, in the order the rank's stream
    reduces the stages (a parameter of two stages of this rank, a tie, goes with the first);
    `whole`: names kept whole."""

    sharded = True

    def __init__(self, stages: dict[int, list[tuple[str, torch.nn.Parameter]]], spec: OptimSpec, *,
                 data_rank: int, data_size: int, whole: Iterable[str] = (), device: torch.device | None = None):
        self.spec, self.rank, self.size = spec, data_rank, data_size
        self.keep_grads = True
        whole = set(whole)
        seen: set[int] = set()
        self.buckets: dict[int, Bucket] = {}
        self.whole: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for s, named in stages.items():
            mine = [(n, p) for n, p in unique_parameters(named) if id(p) not in seen]
            seen.update(id(p) for _, p in mine)
            self.whole[s] = [(n, p) for n, p in mine if n in whole]
            sharded = [(n, p) for n, p in mine if n not in whole]
            if sharded:
                self.buckets[s] = self._bucket(s, sharded, device)
        self.params = [p for s in stages for _, p in self._stage_params(s)]
        self.opt = self._torch_optimizer()
        # what of the current step is done: a transport may raise `Blocked` from a collective
        # (the interpreter), and the engine then runs the instruction again; each part runs once
        self._step_of_done, self._done = None, {}

    def _once(self, step: int, key: tuple, fn):
        """`fn()` unless it already completed in step `step`; its result either way."""
        if self._step_of_done != step:
            self._step_of_done, self._done = step, {}
        if key not in self._done:
            self._done[key] = fn()
        return self._done[key]

    def _stage_params(self, s: int):
        return (self.buckets[s].params if s in self.buckets else []) + self.whole.get(s, [])

    def _bucket(self, stage: int, named, device) -> Bucket:
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise TpirError(Diagnostic(
                f"stage {stage} holds parameters of several dtypes ({', '.join(sorted(map(str, dtypes)))})",
                where="--shard-optimizer", hint="a sharded stage keeps one flat buffer: use one dtype"))
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        chunk = -(-total // self.size)
        size = chunk * self.size
        lo, hi = self.rank * chunk, (self.rank + 1) * chunk
        flat = torch.zeros(size, dtype=dtypes.pop(), device=device or named[0][1].device)
        bucket = Bucket(stage, named, offsets, size, lo, hi, flat)
        for (n, p), o in zip(named, offsets):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                view = p.detach().view(-1)[a - o:b - o]
                view.grad = flat[a:b]
                bucket.pieces.append(Piece(n, p, a - o, b - o, view))
        return bucket

    def _torch_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer over the pieces and the whole parameters, in `param_groups`' groups
        (AdamW: decay on matrices only, by the parameter's own shape; sorted by name)."""
        items = [(pc.name, pc.param.dim(), pc.view) for b in self.buckets.values() for pc in b.pieces]
        items += [(n, p.dim(), p) for named in self.whole.values() for n, p in named]
        if not items:
            return None
        items.sort(key=lambda t: t[0])
        spec = self.spec
        if spec.kind == "sgd":
            return torch.optim.SGD([{"params": [t for _, _, t in items]}], lr=spec.lr, foreach=True)
        from tpc.executors.training.param_groups import bounded_runs

        groups = []
        for members, wd in (([t for _, d, t in items if d >= 2], spec.weight_decay),
                            ([t for _, d, t in items if d < 2], 0.0)):
            groups += [{"params": run, "weight_decay": wd} for run in bounded_runs(members, lambda t: t)]
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, foreach=True)

    # ----------------------------------------------------------------------- the stream

    def reduce(self, stage: int, transport, step: int) -> None:
        """`allreduce stage S`: the sharded gradients reduce-scattered, the whole ones
        allreduced by the transport as without sharding."""
        bucket = self.buckets.get(stage)
        if bucket is not None:
            def scatter():
                bucket.adopt_grads()
                transport.reduce_scatter(stage, bucket.flat)
            self._once(step, ("reduce-scatter", stage), scatter)
        whole = [p for _, p in self.whole.get(stage, [])]
        if whole:
            def allreduce():
                for p in whole:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                views = transport.allreduce(stage, [p.grad for p in whole])
                if views is not None:
                    for p, v in zip(whole, views):
                        p.grad = v
            self._once(step, ("allreduce", stage), allreduce)

    def gradients(self, transport, step: int) -> dict[str, torch.Tensor]:
        """Every parameter's summed gradient (a copy), gathered from the chunks: for checks."""
        out: dict[str, torch.Tensor] = {}
        for s, bucket in self.buckets.items():
            def gather(bucket=bucket, s=s):
                full = bucket.flat.clone()
                transport.all_gather(s, full)
                return full
            full = self._once(step, ("gradients", s), gather)
            for (n, p), o in zip(bucket.params, bucket.offsets):
                out[n] = full[o:o + p.numel()].view_as(p).clone()
        def whole():
            return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                    for named in self.whole.values() for n, p in named}
        out.update(self._once(step, ("gradients", "whole"), whole))
        return out

    def clip(self, max_norm: float, skip: frozenset[str], transport, device, step: int) -> torch.Tensor:
        """The global sum of squared gradients (float64, on the device), each element counted
        once over the pipeline and data-parallel ranks; the gradients scaled when it exceeds
        `max_norm` (> 0). Nothing here reads the device."""
        from tpc.executors.training.clip import clip_coef

        total = torch.zeros((), dtype=torch.float64, device=device)
        for bucket in self.buckets.values():
            for pc in bucket.pieces:
                if pc.name not in skip:
                    total = total + pc.view.grad.detach().to(torch.float64).pow(2).sum()
        if self.rank == 0:
            for named in self.whole.values():
                for n, p in named:
                    if n not in skip and p.grad is not None:
                        total = total + p.grad.detach().to(torch.float64).pow(2).sum()
        total = self._once(step, ("norm", "pipeline"), lambda: transport.sum_over_pipeline(total))
        total = self._once(step, ("norm", "data"), lambda: transport.sum_over_data(total))
        if max_norm > 0:
            def scale():
                coef = clip_coef(total, max_norm)
                for bucket in self.buckets.values():
                    bucket.owned.mul_(coef)
                for named in self.whole.values():
                    for _, p in named:
                        if p.grad is not None:
                            p.grad.detach().mul_(coef)
            self._once(step, ("clip",), scale)
        return total

    def set_lr(self, lr: float) -> None:
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr

    def step(self, transport, step: int) -> None:
        """AdamW on the owned chunks (in the parameters' storage) and the whole parameters, then
        every chunk's new weights gathered to every replica through the gradient buffer, which
        is zeroed for the next step's backward."""
        def update():
            if self.opt is not None:
                self.opt.step()
            with torch.no_grad():
                for bucket in self.buckets.values():  # the new weights of the chunk, to send
                    for (_, p), o in zip(bucket.params, bucket.offsets):
                        a, b = max(bucket.lo, o), min(bucket.hi, o + p.numel())
                        if a < b:
                            bucket.flat[a:b].copy_(p.detach().view(-1)[a - o:b - o])
                for named in self.whole.values():
                    for _, p in named:
                        if p.grad is not None:
                            p.grad.zero_()
        self._once(step, ("update",), update)
        for s, bucket in self.buckets.items():
            self._once(step, ("weights", s), lambda s=s, bucket=bucket: self._gather_weights(s, bucket, transport))

    @staticmethod
    def _gather_weights(stage: int, bucket: Bucket, transport) -> None:
        with torch.no_grad():
            transport.all_gather(stage, bucket.flat)
            for (_, p), o in zip(bucket.params, bucket.offsets):
                p.detach().view(-1).copy_(bucket.flat[o:o + p.numel()])
            bucket.flat.zero_()

    # ------------------------------------------------- what checkpoints ask (model_state.py)

    def _pieces_of(self, p: torch.nn.Parameter) -> list[Piece]:
        return [pc for b in self.buckets.values() for pc in b.pieces if pc.param is p]

    def _whole(self, p: torch.nn.Parameter) -> bool:
        return any(q is p for named in self.whole.values() for _, q in named)

    def optimizes(self, p: torch.nn.Parameter) -> bool:
        return any(q is p for q in self.params)

    def state_of(self, p: torch.nn.Parameter) -> dict | None:
        """The live state of `p` by field: a whole parameter's tensors, or for a sharded one
        `Pieces` of each moment (this rank's parts, perhaps none) and the step count (the same
        on every part). None when it has no state yet."""
        if self.opt is None:
            return None
        if self._whole(p):
            return dict(self.opt.state[p]) if p in self.opt.state else None
        pieces = [pc for pc in self._pieces_of(p) if pc.view in self.opt.state]
        if not pieces:
            return {} if self.optimizes(p) and self.opt.state else None
        out: dict = {}
        for key, value in self.opt.state[pieces[0].view].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == pieces[0].view.numel():
                parts = [Part(pc.lo, pc.hi, self.opt.state[pc.view][key]) for pc in pieces]
                out[key] = Pieces(tuple(p.shape), value.dtype, parts)
            else:
                out[key] = value
        return out

    def init_state(self) -> None:
        """Create every state tensor (one step with zero gradients at rate 0: no weight moves),
        for a checkpoint load to fill."""
        if self.opt is None or self.opt.state:
            return
        saved = [g["lr"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["lr"] = 0.0
        for bucket in self.buckets.values():
            bucket.flat.zero_()
        wholes = [p for named in self.whole.values() for _, p in named]
        for p in wholes:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        for p in wholes:
            p.grad = None
        for g, lr in zip(self.opt.param_groups, saved):
            g["lr"] = lr

    def set_field(self, p: torch.nn.Parameter, field: str, value: torch.Tensor) -> None:
        """Copy a loaded state tensor into every part of `p`'s state here: a whole parameter's
        tensor, or a value every part shares (AdamW's step count)."""
        if self.opt is None:
            return
        with torch.no_grad():
            for t in ([p] if self._whole(p) else [pc.view for pc in self._pieces_of(p)]):
                mine = self.opt.state.get(t, {}).get(field)
                if isinstance(mine, torch.Tensor) and mine is not value and mine.shape == value.shape:
                    mine.copy_(value)

    def forget(self, p: torch.nn.Parameter) -> None:
        if self.opt is None:
            return
        for t in ([p] if self._whole(p) else [pc.view for pc in self._pieces_of(p)]):
            self.opt.state.pop(t, None)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state tensors this rank holds (measured, for the benchmark)."""
        return optimizer_state_bytes(self.opt)


def optimizer_state_bytes(opt: torch.optim.Optimizer | None) -> int:
    """The bytes of every state tensor of a torch optimizer."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
