"""Per-rank memory of a plan: what a rank holds while it runs each instruction.

A rank's stream runs one instruction at a time, so its memory is a function of program order
alone (timing does not matter): walking the stream once gives the memory *during* every
instruction and the peak. What is counted, from the cost model's byte functions:

* parameters `param_bytes(stage)`, their gradients (same size) and the Adam optimizer state
  (two moments: 2x the parameters), for every stage the rank holds, the whole step long. With
  the optimizer state sharded over the data-parallel group (`optimizer_shards` = d, `tpc run
  --shard-optimizer`, ZeRO-1) a rank keeps 2/d x its parameters of state; the parameters and
  the gradients' flat buffer stay whole, and a stage with weight replicas keeps its whole state
  (executors/training/sharded_optimizer.py);
* live activations: what a slice's forward keeps for its backward, `stash_bytes(stage, l, c,
  mb_size)` (c: the tokens before the slice; by default the slice's boundary activation
  `activation_bytes(l, mb_size)`, costmodel/base.py); from the start of its forward (or
  recompute) to the end of its backward (of its backward-weight for a split backward). A `checkpoint` forward keeps no graph; its
  `recompute` rebuilds it. The input a checkpointed forward keeps to recompute from is left
  out (one hidden-state row per token, small next to the graph);
* KV caches: `kv_bytes(stage, l, mb_size)` for every slice of a micro-batch, from the start of
  its first forward on the stage (the runtime allocates the micro-batch's whole buffer then)
  until `free-kv` of that (stage, micro-batch), or the end of the step when there is none. A
  cost model that knows sliding-window layers gives `kv_slice_bytes(stage, lengths, mb_size)`,
  the bytes charged to each slice of the micro-batch: a windowed layer's cache holds only its
  last w - 1 tokens plus a slice, so it is charged min(tokens, w - 1 + longest slice) in all.
  The carried inputs of short causal mixers (a convolution of kernel k, a token shift) are such
  caches, with window k;
* KV gradients: a slice's backward sends gradients into the keys and values of every earlier
  slice of its (stage, micro-batch); the accumulator of slice j exists from the start of the
  first backward of a later slice until `free-kv`;
* held gradients: a split backward keeps, from the start of its `backward-input` to the end of
  its `backward-weight`, the output gradients its weight half needs (dY of dW = dY^T X),
  `held_grad_bytes(stage, l, c, mb_size)` (0 for a cost model that does not know them);
* messages: a received activation or gradient, `message_bytes(l, mb_size)`, from the
  instruction its receive is posted at to the end of the compute that uses it (its forward,
  or its backward / backward-input). Under gloo's rules the executor posts receives ahead of
  their instructions (`semantics.RecvAhead`: `recv_ahead` computes); under NCCL's at their
  own. What a rank sends is not counted: it goes as soon as it is sent (the runtime keeps a
  slice's output only as a gradient edge).

Allocation happens when an instruction starts and release when it ends, so a backward still
holds the activations it consumes. Under unit costs (`activation_bytes` 1 per slice, no
parameters, no KV), the total is the number of live slice activations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tpc.compiler.costmodel.base import CostModel
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Instr, Op, Payload
from tpc.ir.semantics import RecvAhead


@dataclass(frozen=True)
class Memory:
    """What one rank holds at one moment, by kind (bytes; slice activations under unit costs)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv: float = 0.0
    kv_grads: float = 0.0
    held_grads: float = 0.0
    messages: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class RankMemory:
    """A rank's memory during each of its instructions, and the breakdown at the peak."""

    during: tuple[Memory, ...]
    peak: Memory
    peak_index: int  # the first instruction at which the peak is reached (-1: empty stream)


def slice_extent(header: Header, instr: Instr) -> tuple[int, int, int]:
    """(slice length, context = tokens before the slice, micro-batch rows) of an instruction."""
    where = f"`{instr}`"
    if instr.mb is None or instr.mb >= len(header.microbatches):
        raise TpirError(
            Diagnostic(
                f"micro-batch {instr.mb} does not exist (the header has "
                f"{len(header.microbatches)})",
                loc=instr.loc,
                where=where,
                hint="use a micro-batch the header declares, or run `tpc verify` first",
            )
        )
    mb = header.microbatches[instr.mb]
    if instr.slice is None or instr.slice >= len(mb.slices):
        raise TpirError(
            Diagnostic(
                f"slice {instr.slice} does not exist (micro-batch {instr.mb} has "
                f"{len(mb.slices)} slices)",
                loc=instr.loc,
                where=where,
                hint="use a slice the header declares, or run `tpc verify` first",
            )
        )
    lo, hi = mb.slices[instr.slice]
    return hi - lo, lo, mb.size


class _Held:
    """Named allocations of one kind with a running total (summing the dicts at every
    instruction would make long streams quadratic)."""

    def __init__(self):
        self.items: dict[tuple, float] = {}
        self.total = 0.0

    def add(self, key: tuple, nbytes: float) -> None:
        if key not in self.items:
            self.items[key] = nbytes
            self.total += nbytes

    def drop(self, key: tuple) -> None:
        self.total -= self.items.pop(key, 0.0)


def optimizer_bytes(header: Header, rank: int, costs: CostModel, shards: int = 1) -> float:
    """AdamW's state on pipeline rank `rank`: two moments of its stages' parameters, divided
    over `shards` data-parallel ranks where sharded (a stage with weight replicas never is)."""
    total = 0.0
    for s in header.stages_of_rank(rank):
        state = 2 * costs.param_bytes(s)
        total += state if header.stages[s].replicas else state / max(1, shards)
    return total


def rank_memory(header: Header, rank: int, instrs: tuple[Instr, ...], costs: CostModel,
                forward_only: bool = False, recv_ahead: int = RecvAhead.COMPUTES,
                optimizer_shards: int = 1) -> RankMemory:
    """Walk one rank's stream and account its memory (see the module docstring). A
    `forward_only` stream (the evaluation program) keeps no stash: only KV caches come and go
    (parameters, gradients and optimizer state stay allocated through a run's evaluation).
    `recv_ahead`: how many computes ahead receives are posted (gloo's executor; 0: each at its
    own instruction, as under NCCL's rules). `optimizer_shards`: the ranks the optimizer state
    is divided over (the data-parallel size with a sharded optimizer; 1: whole)."""
    params = sum(costs.param_bytes(s) for s in header.stages_of_rank(rank))
    static = dict(params=params, grads=params, optimizer=optimizer_bytes(header, rank, costs, optimizer_shards))
    acts, kv, kv_grads, held = _Held(), _Held(), _Held(), _Held()  # keyed (stage, mb, slice)
    kv_slices: dict[tuple[int, int], list[int]] = {}  # (stage, mb) -> slices with a KV cache
    messages = _Held()  # keyed (payload, stage, mb, slice)

    def message_bytes(j: int) -> float:
        l, _, size = slice_extent(header, instrs[j])
        return costs.message_bytes(l, size)

    def message(j: int) -> None:
        ins = instrs[j]
        messages.add((ins.payload, ins.stage, ins.mb, ins.slice), message_bytes(j))

    ahead = RecvAhead(instrs, message_bytes, recv_ahead)
    during: list[Memory] = []
    for index, instr in enumerate(instrs):
        owner = (instr.stage, instr.mb)
        for j in ahead.before(index):
            message(j)
        if instr.op is Op.RECV:
            ahead.post(index)
            ahead.taken(index)
            message(index)
        if instr.op in (Op.FORWARD, Op.RECOMPUTE):
            l, c, size = slice_extent(header, instr)
            if instr.op is Op.FORWARD and owner not in kv_slices:  # the micro-batch's whole cache
                mb = header.microbatches[instr.mb]
                kv_slices[owner] = list(range(len(mb.slices)))
                for j, nbytes in enumerate(costs.kv_slice_bytes(instr.stage, tuple(hi - lo for lo, hi in mb.slices), size)):
                    kv.add((*owner, j), nbytes)
            if not instr.checkpoint and not forward_only:
                acts.add(instr.key, costs.stash_bytes(instr.stage, l, c, size))
        elif instr.op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            l, c, size = slice_extent(header, instr)  # a located error for a slice the header lacks
            if instr.op is Op.BACKWARD_INPUT:
                held.add(instr.key, costs.held_grad_bytes(instr.stage, l, c, size))
            for j in kv_slices.get(owner, ()):
                if j < instr.slice:
                    kv_grads.add((*owner, j), kv.items[(*owner, j)])
        during.append(Memory(**static, activations=acts.total, kv=kv.total,
                             kv_grads=kv_grads.total, held_grads=held.total, messages=messages.total))
        if instr.op is Op.FORWARD:
            messages.drop((Payload.ACT, *instr.key))
        elif instr.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            messages.drop((Payload.GRAD, *instr.key))
        if instr.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            acts.drop(instr.key)
            held.drop(instr.key)
        elif instr.op is Op.FREE_KV:
            for j in kv_slices.pop(owner, ()):
                kv.drop((*owner, j))
                kv_grads.drop((*owner, j))

    if not during:
        return RankMemory(during=(), peak=Memory(**static), peak_index=-1)
    peak_index = max(range(len(during)), key=lambda i: (during[i].total, -i))
    return RankMemory(during=tuple(during), peak=during[peak_index], peak_index=peak_index)
