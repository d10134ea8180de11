"""Before step 1: derive and compile every program a rank's stages will run.

A compiled program is specialised to one slice shape (`tpc.compiler.programs`), and the plan
names every shape: each micro-batch's rows and slices, on each stage. `prepare` runs each
stage of a rank once over every distinct micro-batch shape, on zeros, through a scratch
runtime that shares the stage's programs: its forwards (and, training, its backwards as the
plan runs them: whole, or split in halves) in the plan's order. That derives and compiles each
program with the very inputs and layouts the step will give it, so no step waits for a
compilation. Nothing of the pass stays: the stage's gradients are put back as they were, the
random number generators too (a dropout draws from them), and its caches are freed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tpc.ir.nodes import Op


def prepare(engine, progress: Callable[[str], None] | None = None) -> tuple[int, float]:
    """Derive and compile the programs of `engine`'s stages (a RankEngine) for every slice
    shape of its plan; returns (programs made, seconds)."""
    from tpc.executors.stage_runtime import StageRuntime
    from tpc.executors.training.batches import split_tokens

    start = time.perf_counter()
    ops: dict[int, set] = {}
    for instr in engine.instrs:
        if instr.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            ops.setdefault(instr.stage, set()).add(instr.op)
    header = engine.header
    made = 0
    for s, built in sorted(engine.stages.items()):
        programs = getattr(built.runtime, "programs", None)
        if programs is None:
            continue
        module = built.runtime.module
        before = len(programs.shapes)
        grads = [(p, p.grad) for p in module.parameters()]
        shapes = sorted({(mb.size, tuple(mb.slices)) for mb in header.microbatches})
        passes = sorted(ops.get(s, set()), key=lambda op: op.value) or [None]
        with torch.random.fork_rng(devices=[engine.device] if engine.device.type == "cuda" else []), \
                engine.compute_context():
            for k, (rows, slices) in enumerate(shapes):
                for how in passes:
                    if progress is not None:
                        progress(f"rank {engine.global_rank} stage {s}: programs for micro-batch shape "
                                 f"{k + 1}/{len(shapes)} ({rows} rows, {len(slices)} slices)")
                    scratch = StageRuntime(module, built.runtime.loss_scale, programs)
                    _run(scratch, engine, rows, slices, how, split_tokens)
        for p, g in grads:
            p.grad = g
        programs.sealed = True
        made += len(programs.shapes) - before
    return made, time.perf_counter() - start


def progress_line(line: str) -> None:
    """One progress line on stderr, rewritten in place."""
    import sys

    print(f"\r{line}\x1b[K", end="", file=sys.stderr, flush=True)


def _run(rt, engine, rows: int, slices, how, split_tokens) -> None:
    """One micro-batch of `rows` rows cut as `slices` through `rt`, on zeros: forwards, then
    backwards (`how`: Op.BACKWARD, Op.BACKWARD_INPUT (then the weight halves), or None:
    forward only)."""
    module, dev = rt.module, engine.device
    length = slices[-1][1]
    ids, targets = split_tokens(torch.zeros(rows, length + 1, dtype=torch.long, device=dev))
    x = ids if module.is_first else torch.zeros(rows, length, engine.hidden_size, device=dev, dtype=engine.dtype)
    for i, (lo, hi) in enumerate(slices):
        tg = targets[:, lo:hi] if module.is_last else None
        if how is None:
            rt.evaluate(0, i, x[:, lo:hi], lo, targets=tg, capacity=length)
        else:
            rt.forward(0, i, x[:, lo:hi], lo, targets=tg, capacity=length)
    if how is not None:
        for i in reversed(range(len(slices))):
            lo, hi = slices[i]
            g = None if module.is_last else torch.zeros(rows, hi - lo, engine.hidden_size, device=dev,
                                                       dtype=engine.dtype)
            if how is Op.BACKWARD:
                rt.backward(0, i, g)
            else:
                rt.backward_input(0, i, g)
        if how is Op.BACKWARD_INPUT:
            for i in range(len(slices)):
                rt.backward_weight(0, i)
    rt.free_kv(0)
