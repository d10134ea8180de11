"""The collectives of a tensor-parallel group, as autograd functions that carry their backward.

A `TensorGroup` is the T ranks of one tensor-parallel group, seen from one of them (`rank`,
`size`) with three out-of-place collectives on tensors: `all_reduce` (sum), `all_gather(dim)`
(the ranks' tensors concatenated along dim, in rank order) and `reduce_scatter(dim)` (the sum,
cut along dim into T equal parts, this rank's part). Each can also be started and waited on
later (`start_all_reduce`, ...: a `Pending`, whose `result` tensor holds the values once
`wait()` returned); the blocking forms are a start waited on at once. Two groups implement it:

- `DistGroup`, over a torch.distributed process group (gloo has no reduce-scatter: there it is
  an all-reduce followed by this rank's part);
- `ThreadGroup`, in one process for T ranks run on T Python threads: each collective is a round,
  numbered in the order the rank starts it (every rank starts the same collectives in the same
  order); a rank puts its tensor in the round, and reads the round once all T are there; every
  rank computes the result from the tensors in rank order, so all ranks get bit-identical sums.
  `thread_groups(T)` makes the T ranks' handles.

The autograd functions (Megatron's names in brackets):

  copy_to_region     [f]  forward identity,        backward all-reduce    (before a column-parallel region)
  reduce_from_region [g]  forward all-reduce,      backward identity      (after a row-parallel output)
  gather_from_region      forward all-gather(dim), backward this rank's part of the gradient
                                                                          (the LM head's logits)
  all_reduce              forward all-reduce,      backward all-reduce
  all_gather(dim)         forward all-gather,      backward reduce-scatter
  reduce_scatter(dim)     forward reduce-scatter,  backward all-gather
  split_to_tokens(dim)    forward this rank's part, backward all-gather  (sequence parallelism)

`all_reduce`, `all_gather` and `reduce_scatter` are each other's adjoints, for values that
differ between ranks; f, g and `gather_from_region` are the cheaper forms Megatron uses where
the value on one side is known to be replicated (the same on every rank).

`STARTED` maps g, `all_gather` and `reduce_scatter` (the functions whose forward communicates)
to their started forms, which return (output, `Pending`) at once; `wait(pending)` comes before
anything reads the output (`overlap.py` places it). Their backward blocks. `STARTED_OPS` does
the same for the collective operators of a traced program (`torch.ops.tpc.tensor_*`), forward
or backward.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.distributed as dist

# how long a thread rank waits at a collective for the others before the group is declared
# broken (a rank that raised never arrives)
BARRIER_TIMEOUT_S = 120.0


class Pending:
    """A collective started and not yet waited on: `result` is its output tensor (allocated at
    the start, of the result's shape), whose values are there once `wait()` has returned."""

    def __init__(self, result: torch.Tensor, finish=None):
        self.result = result
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            with torch.no_grad():  # the values written into `result` are no op of autograd's
                finish()
        return self.result


class TensorGroup(Protocol):
    rank: int
    size: int

    def start_all_reduce(self, t: torch.Tensor) -> Pending: ...

    def start_all_gather(self, t: torch.Tensor, dim: int) -> Pending: ...

    def start_reduce_scatter(self, t: torch.Tensor, dim: int) -> Pending: ...


class _Blocking:
    """The blocking collectives, each its `start_*` form waited on at once."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.start_all_reduce(t).wait()

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self.start_all_gather(t, dim).wait()

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self.start_reduce_scatter(t, dim).wait()


def _gathered_shape(t: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(t.shape)
    shape[dim] *= size
    return shape


class DistGroup(_Blocking):
    """A `TensorGroup` over a torch.distributed process group (None: the default group)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def start_all_reduce(self, t):
        out = t.detach().clone().contiguous()
        work = dist.all_reduce(out, group=self.group, async_op=True)
        return Pending(out, work.wait)

    def start_all_gather(self, t, dim):
        parts = [torch.empty_like(t).contiguous() for _ in range(self.size)]
        work = dist.all_gather(parts, t.detach().contiguous(), group=self.group, async_op=True)
        out = t.new_empty(_gathered_shape(t, dim, self.size))

        def finish():
            work.wait()
            torch.cat(parts, dim=dim, out=out)
        return Pending(out, finish)

    def start_reduce_scatter(self, t, dim):
        if dist.get_backend(self.group) == "gloo":  # gloo has no reduce_scatter
            total = self.start_all_reduce(t)
            out = _part(total.result, dim, self.rank, self.size).contiguous()

            def finish():
                out.copy_(_part(total.wait(), dim, self.rank, self.size))
            return Pending(out, finish)
        parts = [p.contiguous() for p in t.detach().chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[self.rank])
        work = dist.reduce_scatter(out, parts, group=self.group, async_op=True)
        return Pending(out, work.wait)


class _Slots:
    """What the T thread ranks of one group share: the rounds of their collectives, each
    numbered in the order a rank starts them (every rank starts the same collectives in the
    same order), holding each rank's tensor until all T have read the round."""

    def __init__(self, size: int):
        self.size = size
        self.cv = threading.Condition()
        self.rounds: dict[int, list] = {}  # round -> [tensors by rank, how many posted, how many read]
        self.broken = False

    def post(self, round_: int, rank: int, t: torch.Tensor) -> None:
        with self.cv:
            self._check()
            r = self.rounds.setdefault(round_, [[None] * self.size, 0, 0])
            # a copy: the rank goes on once it has read the round, and its tensor's memory may be
            # written again (a compiled program reuses its buffers) while another rank reads it
            r[0][rank] = t.detach().clone()
            r[1] += 1
            self.cv.notify_all()

    def collect(self, round_: int) -> list:
        """The T ranks' tensors of round `round_` (this rank has posted its own), once all are there."""
        with self.cv:
            if not self.cv.wait_for(lambda: self.broken or self.rounds[round_][1] == self.size,
                                    timeout=BARRIER_TIMEOUT_S):
                self.broken = True
                self.cv.notify_all()
            self._check()
            r = self.rounds[round_]
            r[2] += 1
            if r[2] == self.size:
                del self.rounds[round_]
            return list(r[0])

    def abort(self) -> None:
        with self.cv:
            self.broken = True
            self.cv.notify_all()

    def _check(self) -> None:
        if self.broken:
            raise threading.BrokenBarrierError


class ThreadGroup(_Blocking):
    """A `TensorGroup` whose T ranks are T threads of this process (`thread_groups`). Every rank
    computes a result from the T tensors in rank order, so all ranks get bit-identical sums."""

    def __init__(self, shared: _Slots, rank: int):
        self._shared, self.rank, self.size = shared, rank, shared.size
        self._rounds = 0

    def _start(self, t: torch.Tensor, out: torch.Tensor, combine) -> Pending:
        round_ = self._rounds
        self._rounds += 1
        self._shared.post(round_, self.rank, t)
        return Pending(out, lambda: combine(self._shared.collect(round_), out))

    def start_all_reduce(self, t):
        def total(parts, out):
            out.copy_(parts[0])
            for p in parts[1:]:
                out.add_(p)
        return self._start(t, torch.empty_like(t, memory_format=torch.contiguous_format), total)

    def start_all_gather(self, t, dim):
        return self._start(t, t.new_empty(_gathered_shape(t, dim, self.size)),
                           lambda parts, out: torch.cat(parts, dim=dim, out=out))

    def start_reduce_scatter(self, t, dim):
        def own(parts, out):
            total = parts[0].clone()
            for p in parts[1:]:
                total = total + p
            out.copy_(_part(total, dim, self.rank, self.size))
        shape = list(t.shape)
        shape[dim] //= self.size
        return self._start(t, t.new_empty(shape), own)

    def abort(self) -> None:
        """Break the group at once: a rank that failed never arrives, so the others' waits end
        now (threading.BrokenBarrierError) instead of after the timeout."""
        self._shared.abort()


def thread_groups(size: int) -> list[ThreadGroup]:
    """The handles of the `size` ranks of one in-process group, rank r at index r."""
    shared = _Slots(size)
    return [ThreadGroup(shared, r) for r in range(size)]


def _part(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.size(dim)
    if n % size:
        raise ValueError(f"cannot cut dimension {dim} of size {n} into {size} equal parts")
    return t.narrow(dim, rank * (n // size), n // size)


class _Collective(torch.autograd.Function):
    """A collective with its adjoint: `fwd(x, group, dim)` forward, `bwd(grad, group, dim)`
    backward (`dim`: None for those that have none)."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, ctx.dim), None, None, None, None


def _same(x, group, dim):
    return x.view_as(x)


# The blocking collectives as operators of their own (`torch.ops.tpc.tensor_*`), so that a
# trace of a rank's stage (`compiler/programs/joint.py`: make_fx over fake tensors, then
# torch.compile) records each as one node that communicates when the program runs, instead of
# running it while tracing. The group is passed as its number in `_GROUPS` (`group_id`).
_GROUPS: dict[int, "TensorGroup"] = {}


def group_id(group: "TensorGroup") -> int:
    """The number a program's collective nodes name `group` by (given at first use)."""
    gid = getattr(group, "_tpc_id", None)
    if gid is None:
        gid = len(_GROUPS)
        group._tpc_id = gid
        _GROUPS[gid] = group
    return gid


@torch.library.custom_op("tpc::tensor_all_reduce", mutates_args=())
def tensor_all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    return _GROUPS[group].all_reduce(x)


@tensor_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpc::tensor_all_gather", mutates_args=())
def tensor_all_gather(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    return _GROUPS[group].all_gather(x, dim)


@tensor_all_gather.register_fake
def _(x, dim, group):
    return x.new_empty(_gathered_shape(x, dim, _GROUPS[group].size))


@torch.library.custom_op("tpc::tensor_reduce_scatter", mutates_args=())
def tensor_reduce_scatter(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    return _GROUPS[group].reduce_scatter(x, dim)


@tensor_reduce_scatter.register_fake
def _(x, dim, group):
    shape = list(x.shape)
    shape[dim] //= _GROUPS[group].size
    return x.new_empty(shape)


def _sum(x, group, dim):
    return torch.ops.tpc.tensor_all_reduce(x, group_id(group))


def _gather(x, group, dim):
    return torch.ops.tpc.tensor_all_gather(x, dim, group_id(group))


def _scatter(x, group, dim):
    return torch.ops.tpc.tensor_reduce_scatter(x, dim, group_id(group))


def _own_part(x, group, dim):
    return _part(x, dim, group.rank, group.size).contiguous()


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


class _Started(torch.autograd.Function):
    """A collective whose forward is started, not waited on: returns the output tensor at once
    and leaves its `Pending` in `holder`; nothing may read the output before `wait()`. Its
    backward is `bwd`, blocking, as `_Collective`'s."""

    @staticmethod
    def forward(ctx, x, group, dim, start, bwd, holder):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        pending = start(x, group, dim)
        holder.append(pending)
        return pending.result

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, ctx.dim), None, None, None, None, None


def _start_sum(x, group, dim):
    return group.start_all_reduce(x)


def _start_gather(x, group, dim):
    return group.start_all_gather(x, dim)


def _start_scatter(x, group, dim):
    return group.start_reduce_scatter(x, dim)


def _started(x, group, dim, fwd, bwd):
    holder: list = []
    out = _Started.apply(x, group, dim, fwd, bwd, holder)
    return out, holder[0]


def start_reduce_from_region(x, group: TensorGroup):
    """g started (`reduce_from_region`): (its output, its `Pending`); the output's values are
    there once the pending collective is waited on (`wait`)."""
    return _started(x, group, None, _start_sum, _same)


def start_all_gather(x, dim: int, group: TensorGroup):
    """`all_gather` started: (its output, its `Pending`)."""
    return _started(x, group, _dim(x, dim), _start_gather, _scatter)


def start_reduce_scatter(x, dim: int, group: TensorGroup):
    """`reduce_scatter` started: (its output, its `Pending`)."""
    return _started(x, group, _dim(x, dim), _start_scatter, _gather)


def wait(pending: Pending) -> None:
    """Wait for a started collective (`STARTED`): its output's values are there after it."""
    pending.wait()


def copy_to_region(x, group: TensorGroup):
    """Megatron's f: the identity forward, an all-reduce of the gradient backward."""
    return _Collective.apply(x, group, None, _same, _sum)


def reduce_from_region(x, group: TensorGroup):
    """Megatron's g: an all-reduce forward, the identity backward."""
    return _Collective.apply(x, group, None, _sum, _same)


def gather_from_region(x, dim: int, group: TensorGroup):
    """All-gather forward; backward, this rank's part of a gradient every rank holds whole."""
    return _Collective.apply(x, group, _dim(x, dim), _gather, _own_part)


def all_reduce(x, group: TensorGroup):
    return _Collective.apply(x, group, None, _sum, _sum)


def all_gather(x, dim: int, group: TensorGroup):
    return _Collective.apply(x, group, _dim(x, dim), _gather, _scatter)


def reduce_scatter(x, dim: int, group: TensorGroup):
    return _Collective.apply(x, group, _dim(x, dim), _scatter, _gather)


def split_to_tokens(x, dim: int, group: TensorGroup):
    """This rank's part of a value every rank holds whole, along its token dimension `dim`
    (sequence parallelism); backward, the parts' gradients all-gathered, so the whole value's
    gradient is again the same on every rank."""
    return _Collective.apply(x, group, _dim(x, dim), _own_part, _gather)


# the collectives whose forward communicates on its own, and their started forms: a started
# collective returns at once, and its output is read only after `wait`
STARTED = {reduce_from_region: start_reduce_from_region, all_gather: start_all_gather,
           reduce_scatter: start_reduce_scatter}


def start_op_all_reduce(x, group: int):
    """`torch.ops.tpc.tensor_all_reduce` started (in a traced program): (its output, its `Pending`)."""
    pending = _GROUPS[group].start_all_reduce(x)
    return pending.result, pending


def start_op_all_gather(x, dim: int, group: int):
    """`torch.ops.tpc.tensor_all_gather` started: (its output, its `Pending`)."""
    pending = _GROUPS[group].start_all_gather(x, dim)
    return pending.result, pending


def start_op_reduce_scatter(x, dim: int, group: int):
    """`torch.ops.tpc.tensor_reduce_scatter` started: (its output, its `Pending`)."""
    pending = _GROUPS[group].start_reduce_scatter(x, dim)
    return pending.result, pending


# the collective operators of a traced program (`compiler/programs/joint.py`: no autograd there,
# the backward's collectives are operators of the backward program) and their started forms
STARTED_OPS = {torch.ops.tpc.tensor_all_reduce.default: start_op_all_reduce,
               torch.ops.tpc.tensor_all_gather.default: start_op_all_gather,
               torch.ops.tpc.tensor_reduce_scatter.default: start_op_reduce_scatter}


def token_operand(v, like, dim: int, group: TensorGroup):
    """An operand `v`, held whole by every rank, of an op between token-split values (sequence
    parallelism), whose result's token dimension is `dim` (negative: counted from the right, as
    broadcasting aligns); `like` is one of the op's token-split operands. Where `v` runs along
    the tokens (a learned position table, a rotary table), the rank's tokens of it
    (`split_to_tokens`); otherwise (a norm's weight, a bias: the same for every token) `v`
    through f, since each rank's gradient of it covers its own tokens only."""
    if not isinstance(v, torch.Tensor):
        return v
    a = v.dim() + dim
    local = like.size(like.dim() + dim)
    if a >= 0 and v.size(a) == local * group.size and v.size(a) != 1:
        return split_to_tokens(v, a, group) if v.is_floating_point() else _part(v, a, group.rank, group.size)
    if a >= 0 and v.size(a) not in (1, local * group.size):
        raise ValueError(f"an operand of size {v.size(a)} along the tokens meets this rank's {local} tokens "
                         f"of {local * group.size}")
    return copy_to_region(v, group) if v.is_floating_point() else v


def vocab_parallel_embedding(weight, ids, start: int, group: TensorGroup, padding_idx: int = -1):
    """An embedding whose rows [start, start + n) this rank holds (n = weight.size(0)): ids
    outside them look up zeros, and the ranks' lookups are summed (g), so every rank gets the
    whole embedding and each row's gradient reaches only the rank that holds it. The
    embedding's `padding_idx` (a row of the whole vocabulary; -1: none) gets no gradient from
    the lookup, on the rank that holds it."""
    return reduce_from_region(vocab_lookup(weight, ids, start, padding_idx), group)


def vocab_lookup(weight, ids, start: int, padding_idx: int = -1):
    """This rank's part of `vocab_parallel_embedding`, before the sum: its rows' lookups, zeros
    for the ids outside them."""
    n = weight.size(0)
    outside = (ids < start) | (ids >= start + n)
    local = (ids - start).masked_fill(outside, 0)
    # None, not -1: F.embedding reads a negative padding_idx as counted from the last row
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + n else None
    return torch.nn.functional.embedding(local, weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)


def column_lookup(weight, positions, start: int, width: int):
    """A lookup in this rank's columns [start, start + c) of a table of `width` columns (c =
    weight.size(1)), as a value of the whole width with zeros in the other columns: added to a
    partial sum before it is summed over the ranks, each column comes from the rank that holds
    it (a position table folded into the token embedding's sum, `split.py`)."""
    part = torch.nn.functional.embedding(positions, weight)
    return torch.nn.functional.pad(part, (start, width - start - weight.size(1)))


def vocab_parallel_sum_token_loss(logits, targets, start: int, group: TensorGroup):
    """`runtime_ops.sum_token_loss` (cross-entropy summed over the tokens) of logits split over
    the vocabulary: this rank holds the columns [start, start + n) of the logits (n =
    logits.size(-1)). No rank gathers the logits: the ranks exchange, per token, the largest
    logit (no gradient), the sum of the exponentials and the target's logit (each summed with
    g), so the loss is the same on every rank and each rank's logits get their own columns of
    the gradient (softmax minus the one-hot target)."""
    local = logits.reshape(-1, logits.size(-1)).float()  # (N, n)
    tg = targets.reshape(-1)
    n = local.size(-1)
    with torch.no_grad():
        top = _gather(local.amax(dim=-1, keepdim=True), group, 1).amax(dim=-1, keepdim=True)  # (N, 1)
    shifted = local - top
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), group)  # (N,)
    outside = (tg < start) | (tg >= start + n)
    picked = shifted.gather(1, (tg - start).masked_fill(outside, 0).unsqueeze(1)).squeeze(1)
    target_logit = reduce_from_region(picked.masked_fill(outside, 0.0), group)  # (N,)
    return (sum_exp.log() - target_logit).sum()
