"""The evaluation program: the forward-only program a plan carries beside its training streams.

`eval_program(header, microbatches)` builds it for the header's mesh and stages: every rank runs
the forward of every slice of its stages, in the order a pipeline reaches them (slice g of the
whole batch, counted over the micro-batches in order, reaches stage s at step g + s; a rank with
several stages takes its forwards by that step, then by stage, which is one order for all ranks
that every dependency respects, so the program cannot deadlock). Lowering is the training
program's own passes, `insert_loads`, `insert_comm` and `insert_free_kv` (activations only: a
forward sends nothing back; for NCCL, `insert_exchanges` as in training, and `order_exchanges` when
the training's exchanges are ordered), and, with more than one data-parallel replica, `reduce-loss` on the
rank of the last stage after its last forward. Nothing is stashed: the executors run these
forwards without an autograd graph, and each micro-batch's KV cache is freed after its last
slice.

`eval_slicing(...)` chooses the evaluation's micro-batches and token slices with TeraPipe's DP
when a cost model is at hand (`slice_optimiser.optimise(..., backward=False)`: a slot is a
forward and one transfer), with as many micro-batches as training when `--microbatches` fixed
that count (a measured profile knows the micro-batch sizes it was measured at, and a fit
extrapolated to others can misjudge them badly); without a cost model the evaluation takes the
training program's micro-batches and slices.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tpc.compiler.lowering.lower import (
    DEFAULT_EXCHANGES,
    Exchanges,
    insert_comm,
    insert_exchanges,
    insert_free_kv,
    insert_loads,
    order_exchanges,
    pair_slices,
)
from tpc.ir.nodes import EvalProgram, Header, Instr, Microbatch, Op, RankProgram
from tpc.ir.semantics import DEFAULT_COMM, NCCL, CommRules

def forward_order(header: Header) -> dict[int, list[Instr]]:
    """Each rank's forwards: by the pipeline step g + s at which slice g reaches stage s, then
    by stage."""
    work = []
    g = 0
    for mb in header.microbatches:
        for i in range(len(mb.slices)):
            for s in range(header.num_stages):
                work.append((g + s, s, mb.index, i))
            g += 1
    order: dict[int, list[Instr]] = {r: [] for r in range(header.mesh.pipe)}
    for _, s, m, i in sorted(work):
        order[header.stage_rank(s, m)].append(Instr(Op.FORWARD, stage=s, mb=m, slice=i))
    return order


def eval_program(header: Header, microbatches: Sequence[Microbatch] | None = None,
                 comm: CommRules = DEFAULT_COMM, exchanges: Exchanges = DEFAULT_EXCHANGES,
                 pairs: bool = False) -> EvalProgram:
    """The evaluation program of `header`'s mesh and stages, over `microbatches` (default: the
    training program's), on replica 0 of stages with weight replicas, for backend `comm`:
    under NCCL's rendezvous rules a rank holding several stages can wait on a neighbour that
    waits on it (rank 0 sends stage 0's output while rank 1 sends stage 1's back to rank 0),
    so, as in training, `insert_exchanges` pairs those sends and receives (and with
    `exchanges=ORDERED`, `order_exchanges` writes them as single operations). `pairs`
    (`--tensor-overlap`): the forwards of slice pairs brought together (`pair_slices`), as in
    training."""
    mbs = tuple(microbatches) if microbatches is not None else header.microbatches
    # the evaluation runs on replica 0's pipeline (rule E1), where its loss is summed
    mbs = tuple(dataclasses.replace(m, replica=0) if m.replica else m for m in mbs)
    eval_header = dataclasses.replace(header, microbatches=mbs)
    streams = {r: tuple(v) for r, v in forward_order(eval_header).items()}
    nccl = (insert_exchanges,) + ((order_exchanges,) if Exchanges.of(exchanges) is Exchanges.ORDERED else ())
    passes = (insert_loads, insert_comm) + ((pair_slices,) if pairs else ()) + (insert_free_kv,)
    for run in passes + (nccl if comm == NCCL else ()):
        streams = run(eval_header, streams)
    last = header.stage_ranks(header.num_stages - 1)[0]
    if header.mesh.data > 1:
        streams[last] = streams[last] + (Instr(Op.REDUCE_LOSS),)
    ranks = tuple(RankProgram(rank=r, instrs=streams[r]) for r in range(header.mesh.pipe))
    return EvalProgram(microbatches=mbs, ranks=ranks)


def eval_slicing(cost, header: Header, granularity: int | None = None,
                 microbatches: int | None = None) -> tuple[Microbatch, ...]:
    """The evaluation's micro-batches and token slices chosen by the DP with no backward
    (compiler/optimise/slice_optimiser.py), for `header`'s stages under `cost` (a cost model of those
    stages). `microbatches`: how many (the count `--microbatches` fixed for training, so that
    the sizes stay those the cost model was measured at); None lets the knapsack choose."""
    from tpc.compiler.optimise.slice_optimiser import DEFAULT_GRANULARITY, optimise

    choice = optimise(cost, header.num_stages, header.shape.seq, header.replica_batch,
                      microbatches=microbatches, granularity=granularity or DEFAULT_GRANULARITY,
                      data=header.mesh.data, backward=False)
    return tuple(Microbatch(index=m, size=size, slices=tuple(sl))
                 for m, (size, sl) in enumerate(zip(choice.mb_sizes, choice.slices)))
