"""TeraPipe's headline table, predicted by the analytic V100 model and the DP.

Cluster: AWS p3.16xlarge, 8 V100-SXM2 per node on NVLink, 25 Gbit/s between nodes. Device
numbers are public ones (125 TFLOP/s fp16 tensor peak at 60% achieved in large GEMMs, 900 GB/s
HBM at 80%, 10 us per kernel); the same device model prices every row, nothing is fitted to the
paper. Models: GPT-3 shapes, L = 2048; the pipelined stages hold the decoder layers (the
paper's pipeline stages; embedding and LM head left out of the stage times).

For each row: predicted step time with batch slicing only (the best cut of the batch into
micro-batches, no token slicing) and with the DP's micro-batches and token slices, the
predicted speedup next to the paper's measured one, and the shape of the slicing.

Each row's choice is then compiled into a real plan by the functions `tpc compile` runs after
its cost model (`compiler.header.build_header`, `compiler.schedules.build_schedule`,
`compiler.lowering.lower.lower`, verified by `ir.verify.check`): its mesh is `mesh pipe P data
D tensor T` for the rows with an op degree, one unit per decoder layer, the TeraPipe schedule.
The models are too large to trace, so the header's model line names a file that is not read
and the tensor split is the analytic model's (`op`), not one found by `find_split`; the
vocabulary line is GPT-2's padded to 50304 (a multiple of 128, as Megatron-LM pads it, so that
T divides it: rule T2), which changes no time (the stages hold the layers only). The plan is
simulated under the same cost model (`sim`, the simulator's step time of the plan written).

    OMP_NUM_THREADS=1 python bench/paper_table.py
"""

from __future__ import annotations

import time

from tpc.compiler.costmodel import AnalyticCostModel, ModelShapes, even_layers
from tpc.compiler.costmodel.devices import V100
from tpc.compiler.optimise.slice_optimiser import optimise
from tpc.ir.nodes import Microbatch, Plan

L = 2048
GRANULARITY = 8
TOLERANCE = 0.25
# name, layers, hidden, heads, global batch, data, pipe, op, paper unsliced s, paper sliced s
# (None: the paper's measured times for the setting are not at hand here; the row is predicted,
# compiled and simulated, and not compared)
ROWS = [
    ("GPT3-13B", 40, 5120, 40, 32, 1, 40, 8, 1.863, 1.328),
    ("GPT3-44B", 96, 6144, 48, 8, 4, 96, 1, 13.319, 7.103),
    ("GPT3-44B", 96, 6144, 48, 8, 1, 48, 8, 2.662, 1.111),
    ("GPT3-175B", 96, 12288, 96, 2, 1, 48, 8, 5.822, 1.160),
    ("GPT3-175B", 96, 12288, 96, 2, 1, 96, 4, None, None),
]


# GPT-2's vocabulary padded to a multiple of 128 (Megatron-LM's padding): every op degree divides it
VOCAB = 50304
SCHEDULE = "terapipe"


def compile_row(name: str, layers: int, B: int, D: int, P: int, op: int, choice) -> Plan:
    """The DP's `choice` for one row as a verified plan: header, schedule and lowering as `tpc
    compile` makes them (module docstring)."""
    import dataclasses

    from tpc.compiler.header import build_header
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.options import check_options
    from tpc.compiler.schedules import build_schedule, with_replicas
    from tpc.ir.verify import check

    opts = check_options(seq_len=L, batch=B, stages=P, dp=D, tensor=op, schedule=SCHEDULE, quiet=True)
    per = even_layers(layers, P)
    ranges = tuple((sum(per[:s]), sum(per[:s + 1])) for s in range(P))
    header = build_header(model_path=f"{name.lower()}.py", sha256="0" * 64, factory="model", opts=opts,
                          vocab=VOCAB, unit_labels=[f"layer {i}" for i in range(layers)], ranges=ranges,
                          ties=())
    mbs = tuple(Microbatch(index=m, size=b, slices=sl)
                for m, (b, sl) in enumerate(zip(choice.mb_sizes, choice.slices)))
    header = with_replicas(dataclasses.replace(header, microbatches=mbs))
    return check(lower(header, build_schedule(SCHEDULE, header), verify=False))


def shape_of(lengths) -> str:
    """'longer first' when lengths never grow along the sequence, else 'mixed'."""
    if len(lengths) == 1:
        return "one slice"
    return "longer first" if all(a >= b for a, b in zip(lengths, lengths[1:])) else "mixed"


def main() -> int:
    from tpc.compiler.predict.simulate import simulate

    head = (f"{'model':<10} {'data x pipe x op':>16} {'batch':>5} {'no token':>9} {'DP':>8} "
            f"{'pred':>6} {'paper':>6} {'ratio':>6} {'ok':>3}  {'DP s':>5}  slicing (first micro-batch)")
    print(head)
    ok_all = True
    plans = []
    for name, layers, h, heads, B, D, P, op, paper_base, paper_tp in ROWS:
        shapes = ModelShapes(layers, h, heads, 50257, with_embedding=False, with_head=False)
        cost = AnalyticCostModel(V100, shapes, even_layers(layers, P), op)
        t0 = time.perf_counter()
        ch = optimise(cost, P, L, B // D, granularity=GRANULARITY, data=D)
        secs = time.perf_counter() - t0
        pred = ch.unsliced_time / ch.predicted_time
        lengths = [hi - lo for lo, hi in ch.slices[0]]
        shape = shape_of(lengths)
        if paper_base is None:  # nothing to compare with: shown, not judged
            ok = True
            compared = f"{'n/a':>6} {'n/a':>6} {'-':>3}"
        else:
            paper = paper_base / paper_tp
            ratio = pred / paper
            ok = abs(ratio - 1) <= TOLERANCE and shape in ("longer first", "one slice")
            compared = f"{paper:5.2f}x {ratio:6.2f} {'yes' if ok else 'NO':>3}"
        ok_all &= ok
        shown = lengths if len(lengths) <= 12 else lengths[:6] + ["..."] + lengths[-3:]
        print(f"{name:<10} {f'{D} x {P} x {op}':>16} {B:>5} {ch.unsliced_time:8.3f}s "
              f"{ch.predicted_time:7.3f}s {pred:5.2f}x {compared}  {secs:5.2f}  {len(ch.mb_sizes)} mb of "
              f"{ch.mb_sizes[0]}, {len(lengths)} slices {shape}: {shown}")
        if ch.sync_time:
            print(f"{'':<10} {'':>16} {'':>5} (both include {ch.sync_time:.3f} s of gradient "
                  f"all-reduce over {D} replicas, 8 GPUs sharing each node's link)")
        plans.append((name, cost, compile_row(name, layers, B, D, P, op, ch), ch))
    print(f"target: predicted speedup within +-{TOLERANCE:.0%} of the paper's (where its times are at hand), "
          "slices longer first")
    print()
    print(f"the DP's choices compiled ({SCHEDULE}, lowered for NCCL, verified) and simulated:")
    for name, cost, plan, ch in plans:
        h = plan.header
        t0 = time.perf_counter()
        sim = simulate(plan, cost)
        secs = time.perf_counter() - t0
        print(f"{name:<10} mesh {h.mesh.sizes:<26} {sum(len(r.instrs) for r in plan.ranks):>6} instructions "
              f"on {h.mesh.value.size:>3} ranks; sim {sim.iteration_time:7.3f}s (DP {ch.predicted_time:.3f}s) "
              f"[{secs:.1f}s]")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
