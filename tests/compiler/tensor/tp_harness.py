"""Runs the T tensor ranks of a sliced model on T threads of this process (the in-process
group), whole or slice by slice through the stage runtime, and gathers the gradients back to
the model's full shapes."""

from __future__ import annotations

import threading

from tpc.compiler.frontend import SlicedModel
from tpc.compiler.tensor import shard_stage, thread_groups
from tpc.compiler.tensor.shard import full_grads
from tpc.executors.stage_runtime import StageRuntime


def on_threads(degree: int, fn) -> list:
    """fn(rank) on `degree` threads at once; their results in rank order; the first error raised."""
    results, errors = [None] * degree, [None] * degree

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def rank_stages(sm: SlicedModel, ranges, degree: int, sequence: bool = False):
    """stages[rank][stage]: every rank's module of every unit range, rank r on group handle r."""
    groups = thread_groups(degree)
    return [[shard_stage(sm, lo, hi, degree, r, groups[r], sequence=sequence) for lo, hi in ranges]
            for r in range(degree)]


def whole_step(sm: SlicedModel, ids, targets, degree: int):
    """Loss (per rank) and full gradients of one step of the whole model as one stage and one slice."""
    stages = rank_stages(sm, [(0, sm.num_units)], degree)

    def run(r):
        st = stages[r][0]
        y, _ = st(ids, 0, st.empty_kv(ids.size(0)), targets)
        loss = y / targets.numel()
        loss.backward()
        return float(loss.detach())

    losses = on_threads(degree, run)
    return losses, _joined(stages)


def sliced_step(sm: SlicedModel, ranges, ids, targets, lens, degree: int, pairs: bool = False,
                sequence: bool = False, capacity: int | None = None, programs: bool = False):
    """Loss (per rank), full gradients, and the stages, of one step run stage after stage, slice
    by slice through `StageRuntime` (each rank's KV caches hold its own heads). `pairs`: slices
    0 and 1, 2 and 3, ... run as one program each (`StageRuntime.forward_pair`), and with
    `programs` (the stages run their traced programs) the backwards of the last two, the two
    before, ... too (`backward_pair`). `sequence`: with sequence parallelism (a stage after the
    first takes the rank's part of the tokens)."""
    from tpc.compiler.programs.stage_programs import StagePrograms

    stages = rank_stages(sm, ranges, degree, sequence)
    offsets = [sum(lens[:i]) for i in range(len(lens))]

    def run(r):
        runtimes = [StageRuntime(m, 1.0 / targets.numel(), StagePrograms(m) if programs else None)
                    for m in stages[r]]
        acts = {}

        def inputs(s, i, rt):
            off, ln = offsets[i], lens[i]
            x = ids[:, off:off + ln] if s == 0 else acts[(s - 1, i)]
            return x, off, targets[:, off:off + ln] if rt.module.is_last else None

        for s, rt in enumerate(runtimes):
            i = 0
            while i < len(lens):
                if pairs and i + 1 < len(lens):
                    (xa, oa, ta), (xb, ob, tb) = inputs(s, i, rt), inputs(s, i + 1, rt)
                    acts[(s, i)], acts[(s, i + 1)] = rt.forward_pair(0, i, (xa, xb), (oa, ob), (ta, tb), capacity)
                    i += 2
                    continue
                x, off, tg = inputs(s, i, rt)
                acts[(s, i)] = rt.forward(0, i, x, off, tg, capacity=capacity)
                i += 1
        loss = sum(float(acts[(len(runtimes) - 1, i)]) for i in range(len(lens)))
        grads = {}
        for s in reversed(range(len(runtimes))):
            i = len(lens) - 1
            while i >= 0:
                if pairs and programs and i >= 1:
                    grads[(s, i)], grads[(s, i - 1)] = runtimes[s].backward_pair(
                        0, i, (grads.get((s + 1, i)), grads.get((s + 1, i - 1))))
                    i -= 2
                    continue
                grads[(s, i)] = runtimes[s].backward(0, i, grads.get((s + 1, i)))
                i -= 1
            runtimes[s].free_kv(0)
        return loss

    losses = on_threads(degree, run)
    return losses, _joined(stages), stages


def _joined(stages):
    out = {}
    for per_stage in zip(*stages):  # the ranks' modules of one stage
        for name, g in full_grads(list(per_stage)).items():
            out[name] = out[name] + g if name in out else g
    return out
