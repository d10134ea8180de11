"""Runs a sliced model stage after stage, slice by slice, as a pipeline would (one process)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tpc.compiler.frontend.model_file import import_model_file
from tpc.compiler.frontend import SlicedModel
from tpc.compiler.programs.stage_programs import StagePrograms
from tpc.executors.stage_runtime import StageRuntime

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

TINY = {
    "gpt": dict(n_layer=3, n_embd=32, n_head=2, block_size=32),
    "nanogpt": dict(n_layer=3, n_embd=32, n_head=2, block_size=32),
    "llama": dict(n_layer=3, dim=32, n_head=4, n_kv_head=2, max_seq_len=32),
}


def tiny_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return import_model_file(str(EXAMPLES / f"{name}.py")).model(**TINY[name])


def batch(vocab: int, b: int, t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def sliced_step(sm: SlicedModel, ranges, ids, targets, n_mb: int, lens: list[int], *,
                per_stage_copies: bool = True, checkpoint: bool = False, split_backward: bool = False):
    """Loss and gradients of one step, each stage holding its own copy of the parameters.
    Returns (loss, {stage: {name: grad}})."""
    copies = [copy.deepcopy(sm.model) if per_stage_copies else sm.model for _ in ranges]
    modules = [sm.stage_module(lo, hi, params_from=c) for (lo, hi), c in zip(ranges, copies)]
    # a split backward runs the stages' programs (tpc.compiler.programs)
    runtimes = [StageRuntime(m, 1.0 / targets.numel(), StagePrograms(m) if split_backward else None)
                for m in modules]
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    rows = ids.size(0) // n_mb
    loss = 0.0
    for mb in range(n_mb):
        r = slice(mb * rows, (mb + 1) * rows)
        acts = {}
        for s, rt in enumerate(runtimes):
            for i, (off, ln) in enumerate(zip(offsets, lens)):
                x = ids[r, off:off + ln] if s == 0 else acts[(s - 1, i)]
                tg = targets[r, off:off + ln] if rt.module.is_last else None
                acts[(s, i)] = rt.forward(mb, i, x, off, tg, checkpoint=checkpoint)
        loss += sum(float(acts[(len(runtimes) - 1, i)]) for i in range(len(lens)))
        grads = {}
        for s in reversed(range(len(runtimes))):
            rt = runtimes[s]
            for i in reversed(range(len(lens))):
                if checkpoint:
                    rt.recompute(mb, i)
                g_out = grads.get((s + 1, i))
                if split_backward:
                    grads[(s, i)] = rt.backward_input(mb, i, g_out)
                else:
                    grads[(s, i)] = rt.backward(mb, i, g_out)
            if split_backward:
                for i in reversed(range(len(lens))):
                    rt.backward_weight(mb, i)
            assert rt.live_activations == 0
            rt.free_kv(mb)
    per_stage = [{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None} for m in modules]
    return loss, per_stage


def summed(per_stage):
    """Gradients of the whole model: a tied parameter's gradient summed over the stages holding it."""
    out = {}
    for grads in per_stage:
        for n, g in grads.items():
            out[n] = out[n] + g if n in out else g
    return out


def assert_sliced_exact(model, sm: SlicedModel, vocab: int, rows: int, seq: int, microbatches: int, slicings,
                        stages=(2, 3)) -> None:
    """`sm` (the sliced `model`) cut into each number of `stages` and run with each slicing of
    `slicings`: the loss and every gradient within 1e-5 of plain autograd on one batch."""
    from tpc.executors.oracle import reference_step

    from .hf_models import assert_grads_match

    ids, targets = batch(vocab, rows, seq, seed=3)
    ref_loss, ref = reference_step(model, ids, targets)
    for n in stages:
        for lens in slicings:
            loss, per_stage = sliced_step(sm, sm.partition_by_params(n), ids, targets, microbatches, lens)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (n, lens)
            assert_grads_match(summed(per_stage), ref)


def simulated_kv_peaks(config: Path, seq: int, slices: int, vocab: int):
    """`config` (a Hugging Face config.json) compiled for 2 stages x 1 micro-batch of `slices`
    equal slices at length `seq` (gpipe), and tpc simulate's peak KV-cache bytes on each rank
    under the traced-graph cost model: (the SlicedModel, [peak per rank])."""
    from tpc.cli.compile import check_options
    from tpc.compiler.compile import compile_plan
    from tpc.compiler.costmodel import load_cost_model
    from tpc.compiler.frontend import load_model
    from tpc.compiler.predict.memory import rank_memory

    plan = compile_plan(str(config), check_options(stages=2, microbatches=1, seq_len=seq, batch=2, slices=str(slices),
                                                   schedule="gpipe", quiet=True))
    sm = SlicedModel.from_model(load_model(str(config)), seq_len=seq, vocab=vocab, check_slices=None)
    costs = load_cost_model(device_model="h100", sliced=sm, stage_units=[s.units for s in plan.header.stages])
    return sm, [max(m.kv for m in rank_memory(plan.header, p.rank, p.instrs, costs).during) for p in plan.ranks]
