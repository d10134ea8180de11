"""tpc vs torch.distributed.pipelining: iteration time and peak memory, same model, same world.

The model is bench/models/gpt_untied.py (examples/gpt.py, 8 layers, width 128, untied: the
pipelining stages cannot share a tied weight), batch 8 of 256 tokens in 4 micro-batches, on 2
and 4 gloo ranks with one thread each. tpc runs plans from `tpc compile --slices 1 --schedule
gpipe|1f1b` with the distributed executor (`run_plan`, what `tpc run` runs under torchrun);
torch runs ScheduleGPipe / Schedule1F1B over PipelineStages cut at the same unit boundaries as
the plan's stages, loss = mean cross-entropy per micro-batch with scale_grads=True (gradients
divided by the micro-batch count, so both minimise the mean over the batch). Both take a plain
SGD step (no weight decay) and all-reduce the loss for logging every iteration.

The schedules with several model chunks per rank run 2 chunks per rank (2 x ranks stages, stage
s on rank s mod ranks, as both place them): tpc `interleaved` vs ScheduleInterleaved1F1B,
`looped-bfs` vs ScheduleLoopedBFS, `zb-h1` (split backward, W deferred) vs
ScheduleInterleavedZeroBubble; the tpc plans are `tpc compile --stages R --virtual-stages 2
--schedule NAME`, the torch side builds one PipelineStage per local chunk.

- time: in the same processes, steps alternate (a tpc step, then a torch step, ...); per step
  the wall time on rank 0 (every step ends in the all-reduce of the loss, a sync point); the
  ratio is median(tpc) / median(torch) over the measured steps, after warm-up steps.
- memory: fresh processes per framework; per rank, the peak RSS during the steps above the RSS
  just before the first step (after setup, garbage collected, heap trimmed). The ratio compares
  the ranks with the largest peak.
- gradients: one step of each from the same initial weights and batch, before any update: the
  largest relative error max|a-b|/max|b| over parameters.

The V-shaped pairs, zbv vs ScheduleZBVZeroBubble and dualpipev vs ScheduleDualPipeV, run 2 x
ranks stages, stage i and 2p-1-i on rank i in both (torch's "v" placement is the plan's), the
first and the last stage on rank 0.

Targets: tpc 1f1b time ratio <= 1.0 vs Schedule1F1B, memory ratio <= 1.0; interleaved,
looped-bfs, zb-h1, zbv and dualpipev time ratio <= 0.95 vs their torch counterpart, memory
ratio <= 1.0; gradients equal for every pair.

`--compile`: tpc runs `--compile` (every stage's programs compiled by inductor); torch's stage
modules are compiled too (`module.compile()` on each stage's part, as torchtitan compiles per
block) where its schedule allows it, and stay eager where it does not: its split-backward
schedules (ZeroBubble, ZBV, DualPipeV) walk the eager autograd graph to split a backward
(pytorch#161904). Target then: every time ratio <= 0.85, memory <= 1.0. Both sides compile in
a warm-up step before anything is timed or measured.

    OMP_NUM_THREADS=1 python bench/vs_torch_pipelining.py [--steps 12] [--worlds 2,4]
        [--schedules gpipe,1f1b,...,zbv,dualpipev] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, launch, load_note, median, ok, peak_kib,  # noqa: E402
                    reset_peak, table, tpc_run, tpc_setup)

MODEL = "bench/models/gpt_untied.py"
SEQ, BATCH, MICRO = 256, 8, 4
# tpc schedule -> (torch.distributed.pipelining schedule, chunks per rank, time ratio target)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, None),
    "1f1b": ("Schedule1F1B", 1, 1.0),
    "interleaved": ("ScheduleInterleaved1F1B", 2, 0.95),
    "looped-bfs": ("ScheduleLoopedBFS", 2, 0.95),
    "zb-h1": ("ScheduleInterleavedZeroBubble", 2, 0.95),
    "zbv": ("ScheduleZBVZeroBubble", 2, 0.95),
    "dualpipev": ("ScheduleDualPipeV", 2, 0.95),
}
# the V-shaped pairs run 2 stages per rank (stage i and 2p-1-i on rank i, torch's "v" placement)
# and need micro-batches >= 2 x ranks (DualPipeV)
V_SHAPED = {"zbv", "dualpipev"}
# torch's schedules that split a backward by walking the eager autograd graph: no torch.compile
SPLIT_BACKWARD = {"zb-h1", "zbv", "dualpipev"}
LR = 1e-4


# ---------------------------------------------------------------------------- the torch side


def _torch_stage_module(model, units: tuple[int, int]):
    """The part of the GPT that units [lo, hi) of the plan cover: unit 0 is the embeddings,
    units 1..n the blocks, unit n+1 the final norm and the head (as `tpc compile` cuts it)."""
    import torch
    import torch.nn as nn

    lo, hi = units
    n = len(model.transformer.h)

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = lo == 0, hi == n + 2
            if self.first:
                self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
            self.blocks = nn.ModuleList(model.transformer.h[max(lo - 1, 0): min(hi - 1, n)])
            if self.last:
                self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

        def forward(self, x):
            if self.first:
                pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
                x = self.wte(x) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            if self.last:
                x = self.lm_head(self.ln_f(x))
            return x

    return Part()


class TorchPipe:
    """One rank of torch.distributed.pipelining over the plan's stage boundaries."""

    def __init__(self, plan, rank: int, world: int, schedule: str, compile: bool = False):
        import torch
        import torch.nn.functional as F
        from torch.distributed import pipelining

        from tpc.executors.plan_model import load_plan_model

        self.rank, self.world = rank, world
        self.model = load_plan_model(plan, 0)  # the weights tpc builds (seed 0)
        h = plan.header
        self.micro = len(h.microbatches)
        mine = h.stages_of_rank(rank)  # the plan's placement: one stage, or two in a V
        parts = [_torch_stage_module(self.model, h.stages[s].units) for s in mine]
        self.compiled = compile and schedule not in SPLIT_BACKWARD
        if self.compiled:
            for part in parts:
                part.compile()
        stages = [pipelining.PipelineStage(part, s, h.num_stages, torch.device("cpu"))
                  for s, part in zip(mine, parts)]
        self.first = 0 in mine
        self.last = h.num_stages - 1 in mine

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

        cls = getattr(pipelining.schedules, SCHEDULES[schedule][0])
        self.schedule = cls(stages if issubclass(cls, pipelining.schedules.PipelineScheduleMulti) else stages[0],
                            n_microbatches=self.micro, loss_fn=loss_fn, scale_grads=True)
        self.params = [p for part in parts for p in part.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=LR)

    def step(self, tokens, *, keep_grads: bool = False):
        """One iteration: pipeline forward/backward, the loss summed to every rank, an SGD step."""
        import torch
        import torch.distributed as dist

        ids, targets = tokens[:, :-1], tokens[:, 1:]
        losses = []
        inputs = (ids,) if self.first else ()
        if self.last:
            self.schedule.step(*inputs, target=targets, losses=losses)
        else:
            self.schedule.step(*inputs)
        loss = torch.tensor([float(sum(l.detach() for l in losses)) / self.micro if losses else 0.0],
                            dtype=torch.float64)
        dist.all_reduce(loss)
        grads = None
        if keep_grads:
            grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss), grads


# ------------------------------------------------------------------------------ rank targets


def rank_time(rank: int, world: int, plan_path: str, schedule: str, warmup: int, steps: int,
              compile: bool = False):
    """Gradients of both from the same weights and batch, then alternating timed steps."""
    from tpc.executors.training.batches import RandomTokens

    plan, model, sliced = tpc_setup(plan_path)
    h = plan.header.shape
    batches = RandomTokens(0, h.batch, h.seq, h.vocab)
    torch_pipe = TorchPipe(plan, rank, world, schedule, compile)
    tpc_loss = tpc_run(plan, model, sliced, rank, world, 1, record=True, compile=compile)
    torch_loss, torch_grads = torch_pipe.step(batches.get(0), keep_grads=True)

    tpc_times, torch_times = [], []

    def after_tpc_step(step, loss, info):
        tpc_times.append(info["step_time"])
        t0 = time.perf_counter()
        torch_pipe.step(batches.get(step))
        torch_times.append(time.perf_counter() - t0)

    tpc_run(plan, model, sliced, rank, world, warmup + steps, on_step=after_tpc_step, compile=compile)
    return dict(tpc_grads=tpc_loss.first_grads, torch_grads=torch_grads, tpc_loss=tpc_loss.losses[0],
                torch_loss=torch_loss, tpc_times=tpc_times[warmup:], torch_times=torch_times[warmup:])


def rank_memory(rank: int, world: int, plan_path: str, schedule: str, framework: str, steps: int,
                compile: bool = False):
    """Peak RSS (KiB) above the RSS before the first step, over `steps` steps of one framework
    (compiled: after the compilation, which torch makes in a first, unmeasured step)."""
    from tpc.executors.training.batches import RandomTokens

    from tpc.ir.verify import verify_file

    state = {}
    if framework == "torch":
        plan = verify_file(plan_path)
        h = plan.header.shape
        batches = RandomTokens(0, h.batch, h.seq, h.vocab)
        torch_pipe = TorchPipe(plan, rank, world, schedule, compile)
        if torch_pipe.compiled:
            torch_pipe.step(batches.get(0))
        state["base"] = reset_peak()
        for step in range(steps):
            torch_pipe.step(batches.get(step))
    else:
        plan, model, sliced = tpc_setup(plan_path)

        def before(engine, index):  # after every part of setup run_plan does
            if engine.step == 0 and index == 0:
                state["base"] = reset_peak()

        tpc_run(plan, model, sliced, rank, world, steps, before=before, compile=compile)
    return peak_kib() - state["base"]


# ------------------------------------------------------------------------------------ main


def max_rel_error(a: dict, b: dict) -> float:
    from tpc.executors.oracle import gradient_error

    if set(a) != set(b):
        raise RuntimeError(f"different parameters: {sorted(set(a) ^ set(b))}")
    return gradient_error(a, b)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factory", default="model", help="model of bench/models/gpt_untied.py (default: model)")
    ap.add_argument("--worlds", default="2,4", help="ranks (= stages) to compare at (default: 2,4)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default: 2)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each (default: 12)")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps of the memory runs (default: 3)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help=f"tpc schedules to pair with torch's (default: {','.join(SCHEDULES)}); "
                         "zbv and dualpipev run 2 x ranks stages, in a V")
    ap.add_argument("--slices", type=int, default=1,
                    help="token slices per micro-batch of the tpc plans (default: 1, torch's arithmetic; "
                         "more is tpc's token slicing against torch's whole micro-batches)")
    ap.add_argument("--compile", action="store_true", help="tpc `--compile` against torch's stages compiled "
                    "(eager for its split-backward schedules, which cannot be compiled)")
    ap.add_argument("--microbatches", type=int, default=MICRO,
                    help=f"micro-batches per step (default: {MICRO}; dualpipev needs >= 2 x ranks)")
    args = ap.parse_args(argv)
    at_root()
    rows, ok_all = [], True
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            for schedule in args.schedules.split(","):
                torch_name, chunks, target = SCHEDULES[schedule]
                v = schedule in V_SHAPED
                plan = compile_plan(MODEL, Path(tmp) / f"{schedule}{world}.tpir", factory=args.factory,
                                    stages=2 * world if v else world, virtual_stages=1 if v else chunks,
                                    microbatches=args.microbatches, seq_len=SEQ, batch=BATCH, slices=args.slices,
                                    schedule=schedule)
                t0 = time.monotonic()
                timed = launch(world, rank_time, plan, schedule, args.warmup, args.steps, args.compile)
                mem = {fw: launch(world, rank_memory, plan, schedule, fw, args.mem_steps, args.compile)
                       for fw in ("tpc", "torch")}
                if args.compile:
                    target = 0.85
                    torch_name += " (eager)" if schedule in SPLIT_BACKWARD else " (compiled)"
                tpc_g = {n: g for r in timed for n, g in r["tpc_grads"].items()}
                torch_g = {n: g for r in timed for n, g in r["torch_grads"].items()}
                err = max_rel_error(tpc_g, torch_g)
                t_tpc, t_torch = median(timed[0]["tpc_times"]), median(timed[0]["torch_times"])
                ratio = t_tpc / t_torch
                mem_ratio = max(mem["tpc"]) / max(mem["torch"])
                good = (ratio <= target and mem_ratio <= 1.0 and err <= 1e-5) if target else err <= 1e-5
                ok_all &= good
                rows.append([f"{world} ranks{f' x {chunks} chunks' if chunks > 1 else ''}, {schedule} vs {torch_name}",
                             f"{t_tpc * 1e3:.0f} / {t_torch * 1e3:.0f}", f"{ratio:.3f}",
                             " ".join(f"{m / 1024:.0f}" for m in mem["tpc"]) + " / "
                             + " ".join(f"{m / 1024:.0f}" for m in mem["torch"]),
                             f"{mem_ratio:.3f}", f"{err:.1e}",
                             (f"{ok(good)} (time <= {target})" if target else "-")])
                print(f"  {rows[-1][0]}: {time.monotonic() - t0:.0f} s: {' | '.join(rows[-1][1:])}", file=sys.stderr,
                      flush=True)
    print(f"tpc vs torch.distributed.pipelining on {MACHINE}: {'both compiled' if args.compile else 'eager'}, "
          f"GPT untied ({args.factory}), batch {BATCH} x {SEQ} tokens, "
          f"{args.microbatches} micro-batches, tpc in {args.slices} token slice{'s' * (args.slices > 1)} each, gloo, "
          f"1 thread per rank; {args.steps} alternating timed steps; {load_note()}")
    print(table(["setup", "ms/iter tpc / torch", "time ratio", "peak MiB per rank tpc / torch",
                 "memory ratio", "grad rel. err", "target met"], rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
