"""Token slicing on one GPU: what slicing costs each stage, the FLOP/s the interpreter reaches,
and which attention kernel a sliced stage runs.

The model is bench/models/gpt_untied.py's `gpt350m` (examples/gpt.py at GPT-2-medium's shape:
24 layers, width 1024, 16 heads, vocabulary 50304, tied embedding; 355.9M parameters), one
sequence of L=2048 tokens, compiled in this process by `tpc compile --stages 4 --microbatches 1
--schedule terapipe` twice: `--slices 8` (8 equal slices of 256 tokens) and `--slices 1`.
Compute runs under bf16 autocast on CUDA (`RunOptions(bf16=True)`, `tpc run --bf16`:
weights, gradients and messages fp32).

1. Slicing overhead, per stage: the stage module of each of the 4 stages, run by the executors'
   `StageRuntime`, does forward + backward of the whole sequence as 1 slice, and as the plan's
   8 slices back to back (forward 0..7, backward 7..0: the sum of the slice times), each slice's
   KV buffers sized once for the whole sequence, as the engine sizes them (`capacity`). The two
   alternate `--repeats` times after one warm-up each (synchronised before and after on CUDA);
   the ratio is median(8 slices) / median(1 slice).
2. Achieved TFLOP/s: the reference interpreter (`tpc.executors.interpreter.interpret`, what
   `tpc run --interpret` runs) trains with the 8-slice plan and with the unsliced plan on this
   one device, AdamW, random tokens: `--repeats` alternating blocks of `--block` timed steps
   after a warm-up step each. A step is timed from the end of the previous one (synchronised)
   to its own end. The FLOPs of a step are the project's own count (compiler/frontend/flops.py,
   `SlicedModel.unit_costs`): forward + backward of every unit for every slice of the plan,
   matmuls, attention (the full l x (c+l) rectangle of a slice after c cached tokens) and
   elementwise ops. The interpreter runs the 4 pipeline ranks one after another in one process,
   so this is the utilisation of the serialised plan (no pipelining across GPUs), compared with
   the dense bf16 tensor peak of the device preset (compiler/costmodel/devices.py) that
   `torch.cuda.get_device_name()` names.
3. Attention kernel: `torch.profiler` over forward + backward of the first slice (no prefix:
   SDPA with is_causal) and of the last slice (a 1792-token prefix: on CUDA SDPA with the
   `causal_lower_right` bias, on CPU with an additive bottom-right mask) of stage 1; the scaled-dot-product ops and, on CUDA, the GPU kernels whose names say
   attention (flash, fmha/efficient, cuDNN), and whether the flash kernel ran.

    python bench/gpu_slicing.py [--repeats 5] [--block 2]

A smoke run on a CPU (the same code paths, a tiny model, fp32; under 30 s on 2 cores):

    OMP_NUM_THREADS=1 python bench/gpu_slicing.py --device cpu --model tiny --seq-len 128 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import at_root, compile_plan, load_note, median, table  # noqa: E402

MODEL = "bench/models/gpt_untied.py"
FACTORIES = {"350m": "gpt350m", "tiny": "gpt350m_tiny"}


# ---------------------------------------------------------------------------- devices


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_context(device, bf16: bool):
    """What the engine wraps compute in: bf16 autocast, or nothing."""
    import torch

    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def device_name(device) -> str:
    """The GPU's name, or the CPU model and core count (the name `tpc profile` records)."""
    import torch

    from tpc.executors.profile import device_name as profiled_name

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {profiled_name('cpu').removeprefix('cpu:')} ({os.cpu_count()} cores)"


def peak_preset(device):
    """The device preset whose name the GPU's name contains (None on a CPU or an unknown GPU)."""
    from tpc.compiler.costmodel.devices import PRESETS

    if device.type != "cuda":
        return None
    name = device_name(device).lower()
    return next((spec for key, spec in PRESETS.items() if key in name), None)


# ------------------------------------------------------------------ 1. slicing overhead


class StageBench:
    """One stage module, its runtime and fixed inputs for the whole sequence on `device`."""

    def __init__(self, stage, cuts_sliced, L: int, hidden: int, vocab: int, device, seed: int,
                 compile: bool = False):
        import torch

        from tpc.compiler.programs.stage_programs import ProgramOptions, StagePrograms
        from tpc.executors.stage_runtime import StageRuntime

        self.stage, self.device, self.L = stage, device, L
        self.rt = StageRuntime(stage, 1.0 / L, StagePrograms(stage, ProgramOptions(compile=True)) if compile else None)
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (1, L + 1), generator=g).to(device)
        self.x = self.ids[:, :L] if stage.is_first else torch.randn(1, L, hidden, generator=g).to(device)
        self.g = None if stage.is_last else torch.randn(1, L, hidden, generator=g).to(device)
        self.cuts = {1: [(0, L)], len(cuts_sliced): list(cuts_sliced)}

    def run(self, n: int, ctx) -> float:
        """Seconds for the forward of the n slices in order, then their backward in reverse."""
        cuts = self.cuts[n]
        sync(self.device)
        t0 = time.perf_counter()
        with ctx:
            for i, (a, b) in enumerate(cuts):  # the KV capacity the engine passes: the whole length
                self.rt.forward(0, i, self.x[:, a:b], a, self.ids[:, a + 1:b + 1], capacity=self.L)
            for i in reversed(range(len(cuts))):
                a, b = cuts[i]
                self.rt.backward(0, i, None if self.g is None else self.g[:, a:b])
        sync(self.device)
        t = time.perf_counter() - t0
        self.rt.free_kv(0)
        self.stage.zero_grad(set_to_none=True)
        return t


def slicing_overhead(benches, n: int, repeats: int, ctx) -> list[tuple[float, float]]:
    """Per stage, median seconds of (1 slice, n slices), the two alternating."""
    out = []
    for b in benches:
        b.run(1, ctx), b.run(n, ctx)
        one, many = [], []
        for _ in range(repeats):
            one.append(b.run(1, ctx))
            many.append(b.run(n, ctx))
        out.append((median(one), median(many)))
    return out


# ------------------------------------------------------------------ 2. interpreter steps


def plan_flops(sliced, plan) -> float:
    """Forward + backward FLOPs of one step of `plan` by the project's count (flops.py)."""
    total = 0.0
    for mb in plan.header.microbatches:
        for lo, hi in mb.slices:
            for cost in sliced.unit_costs(hi - lo, lo, mb.size):
                total += float(cost.total("fwd").flops) + float(cost.total("bwd").flops)
    return total * plan.header.mesh.data


def interpreter_block(plan, model, sliced, device, bf16: bool, steps: int, seed: int, compile: bool = False):
    """`interpret` of `steps` + 1 steps: the step times after the first, and the first loss."""
    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.interpreter import interpret
    from tpc.executors.options import RunOptions

    h = plan.header
    times, losses, last = [], [], []

    def on_step(step, loss, info):
        sync(device)
        now = time.perf_counter()
        if last:
            times.append(now - last[-1])
        last.append(now)
        losses.append(loss)

    # the interpreter's own stages (cut from `sliced`), on `device`, under the engine's autocast;
    # no copy of the gradients is kept (a training run keeps none inside its steps)
    interpret(plan, RunOptions(steps=steps + 1, seed=seed, device=device.type, bf16=bf16, lr_schedule="constant",
                               compile=compile, quiet=True),
              model=model, sliced=sliced, batches=RandomTokens(seed, h.shape.batch, h.shape.seq, h.shape.vocab),
              verify=False, on_step=on_step, keep_grads=False)
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return times, losses[0]


# -------------------------------------------------------------------- 3. attention kernel

_FUSED = (("flash", ("_scaled_dot_product_flash_attention", "_flash_attention_forward")),
          ("cuDNN", ("_scaled_dot_product_cudnn_attention", "_cudnn_attention_forward")),
          ("efficient", ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward")),
          ("math", ("_scaled_dot_product_attention_math",)))
_KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa")


def short_kernel(name: str) -> str:
    """A GPU kernel's name without its return type, template arguments and parameters."""
    name = name.removeprefix("void ")
    for stop in ("<", "("):
        name = name.split(stop, 1)[0]
    return name[:60]


def attention_profile(bench: StageBench, cut: int, ctx) -> dict:
    """Profile forward + backward of slice `cut` of the bench's sliced plan (earlier slices run
    forward first, outside the profile); the attention ops and kernels it ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuts = bench.cuts[max(bench.cuts)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    with ctx:
        for i in range(cut):
            a, b = cuts[i]
            bench.rt.forward(0, i, bench.x[:, a:b], a, bench.ids[:, a + 1:b + 1], capacity=bench.L)
    sync(bench.device)
    a, b = cuts[cut]
    with profile(activities=activities) as prof:
        with ctx:
            bench.rt.forward(0, cut, bench.x[:, a:b], a, bench.ids[:, a + 1:b + 1], capacity=bench.L)
            bench.rt.backward(0, cut, None if bench.g is None else bench.g[:, a:b])
        sync(bench.device)
    bench.rt.free_kv(0)
    bench.stage.zero_grad(set_to_none=True)
    ops, kernels = set(), set()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if any(w in ev.name.lower() for w in _KERNEL_WORDS):
                kernels.add(short_kernel(ev.name))
        elif ev.name.startswith("aten::") and "attention" in ev.name:
            ops.add(ev.name.removeprefix("aten::"))
    ops.discard("scaled_dot_product_attention")  # the entry point; the op it dispatches to says which
    path = next((kind for kind, names in _FUSED if any(o.startswith(n) for o in ops for n in names)), None)
    if path is None:
        names = {ev.name for ev in prof.events()}
        path = "math (softmax + bmm)" if {"aten::_softmax", "aten::bmm"} <= names else "none found"
    flash = path == "flash" or any("flash" in k.lower() and "cudnn" not in k.lower() for k in kernels)
    return dict(slice=cut, start=a, length=b - a, path=path, flash=flash, ops=sorted(ops), kernels=sorted(kernels))


# ------------------------------------------------------------------------------- main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda | cpu (default: cuda)")
    ap.add_argument("--model", choices=sorted(FACTORIES), default="350m",
                    help="350m: gpt350m (default); tiny: its smoke-test stand-in")
    ap.add_argument("--seq-len", type=int, default=2048, help="sequence length L (default: 2048)")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages (default: 4)")
    ap.add_argument("--slices", type=int, default=8, help="equal token slices of the sliced plan (default: 8)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast (default: on CUDA yes, on a CPU no)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="alternations of the two sides of each measurement (default: 5)")
    ap.add_argument("--block", type=int, default=2,
                    help="timed interpreter steps per block, after one warm-up step (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="weights and tokens (default: 0)")
    ap.add_argument("--compile", action="store_true", help="the stages' programs compiled (`tpc run --compile`); "
                    "the first run of each shape compiles it (outside the timed runs)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but CUDA is not available; for the smoke run use "
              "--device cpu --model tiny --seq-len 128 --repeats 1", file=sys.stderr)
        return 2
    if device.type not in ("cuda", "cpu"):
        print(f"error: --device {args.device}: use cuda or cpu", file=sys.stderr)
        return 2
    bf16 = device.type == "cuda" if args.bf16 is None else args.bf16
    ctx = compute_context(device, bf16)
    at_root()
    from tpc.executors.plan_model import load_plan_model, slice_model
    from tpc.ir.verify import verify_file

    factory, L, n = FACTORIES[args.model], args.seq_len, args.slices
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        common = dict(factory=factory, stages=args.stages, microbatches=1, seq_len=L, batch=1, schedule="terapipe")
        sliced_plan = verify_file(compile_plan(MODEL, Path(tmp) / "sliced.tpir", slices=n, **common))
        plain_plan = verify_file(compile_plan(MODEL, Path(tmp) / "plain.tpir", slices=1, **common))
    stages = [st.units for st in sliced_plan.header.stages]
    if stages != [st.units for st in plain_plan.header.stages]:
        raise RuntimeError("the sliced and the unsliced plan cut the model into different stages")
    cuts = list(sliced_plan.header.microbatches[0].slices)
    model = load_plan_model(sliced_plan, args.seed)
    params = sum(p.numel() for p in model.parameters())
    sm = slice_model(model, sliced_plan)
    vocab = sliced_plan.header.shape.vocab

    # 1 and 3: stage modules on one copy of the weights on the device
    on_dev = copy.deepcopy(model).to(device)
    modules = [sm.stage_module(lo, hi, params_from=on_dev) for lo, hi in stages]
    benches = [StageBench(m, cuts, L, sm.hidden_size, vocab, device, args.seed + s, args.compile)
               for s, m in enumerate(modules)]
    overhead = slicing_overhead(benches, n, args.repeats, ctx)
    probe = benches[1] if len(benches) > 1 else benches[0]
    attention = [attention_profile(probe, 0, ctx), attention_profile(probe, len(cuts) - 1, ctx)]
    del benches, modules, on_dev, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 2: the interpreter, unsliced and sliced plans alternating
    times = {"plain": [], "sliced": []}
    first_loss = {}
    for _ in range(args.repeats):
        for key, plan in (("plain", plain_plan), ("sliced", sliced_plan)):
            ts, loss = interpreter_block(plan, model, sm, device, bf16, args.block, args.seed, args.compile)
            times[key] += ts
            first_loss[key] = loss
    preset = peak_preset(device)

    mode = ("bf16 autocast" if bf16 else "fp32") + (", --compile" if args.compile else ", eager")
    print(f"{device_name(device)}, torch {torch.__version__}, {mode}; {factory} ({params / 1e6:.1f}M parameters), "
          f"L={L}, batch 1, {len(stages)} stages, {n} slices of {cuts[0][1] - cuts[0][0]} tokens; "
          f"alternations: {args.repeats}; {load_note()}")
    print()
    rows, tot1, totn = [], 0.0, 0.0
    for s, ((lo, hi), (t1, tn)) in enumerate(zip(stages, overhead)):
        tot1, totn = tot1 + t1, totn + tn
        rows.append([f"stage {s} (units {lo}:{hi})", f"{t1 * 1e3:.2f}", f"{tn * 1e3:.2f}", f"{tn / t1:.3f}"])
    rows.append(["all stages", f"{tot1 * 1e3:.2f}", f"{totn * 1e3:.2f}", f"{totn / tot1:.3f}"])
    print(f"slicing overhead: forward + backward of L={L} tokens per stage, StageRuntime, median ms")
    print(table(["stage", "1 slice ms", f"{n} slices ms (sum)", f"{n} slices / 1 slice"], rows))
    print()

    peak = preset.peak_flops if preset is not None else None
    rows = []
    for key, plan in (("plain", plain_plan), ("sliced", sliced_plan)):
        flops, t = plan_flops(sm, plan), median(times[key])
        achieved = flops / t
        k = len(plan.header.microbatches[0].slices)
        rows.append([f"{len(stages)} stages x {k} slice{'s' if k > 1 else ''}", f"{t * 1e3:.1f}",
                     f"{first_loss[key]:.4f}", f"{flops / 1e12:.4g}", f"{achieved / 1e12:.3g}",
                     f"{peak / 1e12:.0f}" if peak else "-", f"{achieved / peak:.1%}" if peak else "-"])
    ratio = median(times["sliced"]) / median(times["plain"])
    print(f"interpreter (every stage one after another on this device, AdamW): median step ms over "
          f"{len(times['sliced'])} steps each; TFLOP per step by the project's count; peak: "
          + (f"preset {preset.name}, dense bf16 tensor" if preset else "no device preset for this device"))
    print(table(["plan", "step ms", "loss (step 1)", "TFLOP / step", "achieved TFLOP/s", "peak TFLOP/s",
                 "of peak"], rows))
    print(f"sliced / unsliced step time: {ratio:.3f}")
    print()

    rows = []
    for a in attention:
        case = f"slice {a['slice']}: tokens {a['start']}:{a['start'] + a['length']}, " + \
            ("no prefix" if a["start"] == 0 else f"prefix of {a['start']}")
        rows.append([case, a["path"], "yes" if a["flash"] else "no", ", ".join(a["ops"]) or "-",
                     ", ".join(a["kernels"]) or "-"])
    print(f"attention kernel: stage {1 if len(stages) > 1 else 0}, forward + backward of one slice, torch.profiler")
    print(table(["slice", "SDPA path", "flash", "attention ops", "GPU attention kernels"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
