"""How much of the tensor group's communication the slice pairs hide (`--tensor-overlap`).

Two processes hold one stage as a tensor group of 2 (`--tensor 2`; gloo on the CPU, NCCL with
`--device cuda`), a GPT of examples/gpt.py cut into token slices. Two runs of the same model,
batch and slices, alternated in each repeat on the same process group:

- plain: the plan without `--tensor-overlap`, run with `slice_pairs=False` (`tpc run
  --no-slice-pairs`): each slice's forward and backward alone, eagerly, its collectives blocking;
- paired: `--tensor-overlap`, slices 0 and 1, 2 and 3, ... run as one program forward, and
  slices 7 and 6, 5 and 4, ... as one program backward (through the stage's traced programs),
  in which each slice's collectives are started and waited on where their values are read, the
  other slice computing in between (compiler/tensor/overlap.py).

(A single stage's stream holds its forwards, and its backwards, side by side whether or not it
was compiled with `--tensor-overlap`: the executors pair whatever is side by side, so the plain
run has to ask for no pairs.)

Printed per run: the median step time and, on the CPU, the exposed communication per step of
the forward and of the backward: the time the rank spent waiting for their collectives (a
blocking call, or the wait of a started one), measured around `collectives.Pending.wait` while
a forward or a backward runs. Then the ratios paired / plain. The paired run's stage runs its
traced programs and the plain run's runs eagerly, so the step-time ratio holds that difference
too (on the CPU the programs run the eager kernels, one by one); `--schedule zb-h1` (a split
backward) runs both through the programs, so that the ratio is the pairs' alone. On CUDA a wait
blocks the stream, not the host, so only the step times are printed.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/tensor_overlap.py [--steps 6] [--repeats 3] [--schedule zb-h1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

_state = threading.local()
_waited = {"forward": 0.0, "backward": 0.0}
PHASES = {"forward": "forward", "forward_pair": "forward", "backward": "backward",
          "backward_pair": "backward", "backward_input": "backward"}


def _instrument() -> None:
    """Time `Pending.wait` while a forward or a backward runs (`StageRuntime`'s methods)."""
    from tpc.compiler.tensor import collectives
    from tpc.executors.stage_runtime import StageRuntime

    wait = collectives.Pending.wait

    def timed_wait(self):
        phase = getattr(_state, "phase", None)
        if phase is None:
            return wait(self)
        t = time.perf_counter()
        try:
            return wait(self)
        finally:
            _waited[phase] += time.perf_counter() - t

    collectives.Pending.wait = timed_wait
    for name, phase in PHASES.items():
        run = getattr(StageRuntime, name)

        def in_phase(self, *a, _run=run, _phase=phase, **k):
            _state.phase = _phase
            try:
                return _run(self, *a, **k)
            finally:
                _state.phase = None

        setattr(StageRuntime, name, in_phase)


def _zero(pipe) -> None:
    for p in pipe.parameters():
        p.grad = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (NCCL, each rank on cuda:LOCAL_RANK)")
    ap.add_argument("--schedule", default="gpipe", help="gpipe (the plain run eager, the paired run through "
                    "the stage's traced programs) | zb-h1 (a split backward: both runs through the programs, "
                    "so the ratio is the pairs' alone)")
    args = ap.parse_args(argv)
    import tpc
    from gpt import model as gpt

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    _instrument()
    L, B = args.seq_len, args.batch
    common = dict(seq_len=L, batch=B, stages=1, tensor=2, microbatches=1, slices=args.slices, schedule=args.schedule,
                  comm="nccl" if cuda else "gloo", quiet=True)
    pipes = {}
    for k in ("plain", "paired"):  # a model each: a pipeline keeps only its rank's part of the weights
        torch.manual_seed(0)
        model = gpt(n_layer=args.layers, n_embd=args.width, n_head=8, block_size=L)
        plan = tpc.compile(model, tensor_overlap=k == "paired", **common)
        pipes[k] = tpc.pipeline(plan, model, device=args.device, slice_pairs=k == "paired")
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (B, L + 1), generator=data)
    times: dict[str, list] = {k: [] for k in pipes}
    exposed: dict[str, dict] = {k: {"forward": [], "backward": []} for k in pipes}
    for k, pipe in pipes.items():  # warm-up: one step each
        pipe.step(tokens[:, :-1], tokens[:, 1:])
        _zero(pipe)
    for _ in range(args.repeats):
        for k, pipe in pipes.items():
            for _ in range(args.steps):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                _waited.update(forward=0.0, backward=0.0)
                t = time.perf_counter()
                loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
                float(loss)
                if cuda:
                    torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t)
                for phase in _waited:
                    exposed[k][phase].append(_waited[phase])
                _zero(pipe)
    if rank == 0:
        dev = torch.cuda.get_device_name() if cuda else f"CPU, {os.environ.get('OMP_NUM_THREADS', '?')} thread(s) a rank"
        print(f"GPT {args.layers} layers, width {args.width}, L={L}, batch {B}, {args.slices} slices, "
              f"{args.schedule}; one stage, "
              f"tensor 2 ({'NCCL' if cuda else 'gloo'}, {dev}); median of {args.repeats} x {args.steps} steps")
        med = {k: statistics.median(v) for k, v in times.items()}
        wait = {k: {ph: statistics.median(v) for ph, v in w.items()} for k, w in exposed.items()}
        for k in pipes:
            extra = "" if cuda else "".join(f"   {ph}'s exposed communication {wait[k][ph] * 1e3:8.2f} ms"
                                            for ph in ("forward", "backward"))
            print(f"  {k:7s} step {med[k] * 1e3:8.2f} ms{extra}")
        line = f"paired / plain: step {med['paired'] / med['plain']:.3f}"
        for ph in ("forward", "backward"):
            if not cuda and wait["plain"][ph] > 0:
                line += f", {ph}'s exposed communication {wait['paired'][ph] / wait['plain'][ph]:.3f}"
        print(line, flush=True)
    for pipe in pipes.values():
        with contextlib.suppress(Exception):
            pipe.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
